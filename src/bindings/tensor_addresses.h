// graphsafe._C's tensor address reading (tensor_addresses.cpp says what and why).
#pragma once

#include <nanobind/nanobind.h>

namespace nb = nanobind;

namespace graphsafe::bindings {

// Adds TensorAddresses and tensor_addresses to the module.
void register_tensor_addresses(nb::module_& m);

}  // namespace graphsafe::bindings
