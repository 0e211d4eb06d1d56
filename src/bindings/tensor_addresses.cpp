// Tensor addresses read in C++ (graphsafe._C.TensorAddresses, tensor_addresses), for the optimizer's cached
// at-once path (python/graphsafe/optim/_fast_path.py), whose eager steps over many tensors are bound by the host.
//
// The core never sees a tensor, only addresses, and links no torch; the address of a torch tensor is read here
// through the reader torch itself publishes for compiled code to call on a tensor's Python object
// (torch._C._dynamo.guards._torchinductor_pyobject_tensor_data_ptr: the address of a C function taking the
// object and returning Tensor.data_ptr()). Python hands that address over with the tensors; _fast_path.py
// checks once, at import, that it gives what Tensor.data_ptr gives, and otherwise reads the addresses itself.
// A read costs a function call, where Tensor.data_ptr through map costs a Python method call and an int each.
// The reader raises a C++ exception for an object it cannot read (not a tensor, or one without storage): that
// is never let through the C boundary here: the answer is then "changed" (unchanged) or a Python error
// (reading).
#include "bindings/tensor_addresses.h"

#include <nanobind/stl/vector.h>

#include <cstdint>
#include <stdexcept>
#include <utility>
#include <vector>

namespace graphsafe::bindings {
namespace {

using AddressReader = void* (*)(PyObject*);

AddressReader as_reader(std::uintptr_t address) {
  if (address == 0) throw std::invalid_argument("tensor address reader: 0 is no function");
  return reinterpret_cast<AddressReader>(address);
}

// The addresses of `tensors`, in order; a tensor the reader refuses raises ValueError naming its position.
std::vector<std::uintptr_t> read_addresses(AddressReader reader, const std::vector<nb::object>& tensors) {
  std::vector<std::uintptr_t> addresses(tensors.size());
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    try {
      addresses[i] = reinterpret_cast<std::uintptr_t>(reader(tensors[i].ptr()));
    } catch (...) {
      throw std::invalid_argument("tensor_addresses: object " + std::to_string(i) + " has no address to read");
    }
  }
  return addresses;
}

// Tensors with the addresses they had when it was made; holds them (and so keeps them alive).
class TensorAddresses {
 public:
  TensorAddresses(std::uintptr_t reader, std::vector<nb::object> tensors)
      : reader_(as_reader(reader)), tensors_(std::move(tensors)), addresses_(read_addresses(reader_, tensors_)) {}

  const std::vector<std::uintptr_t>& addresses() const { return addresses_; }

  // Whether every tensor is still at its address (false too where the reader refuses one).
  bool unchanged() const {
    for (std::size_t i = 0; i < tensors_.size(); ++i) {
      try {
        if (reinterpret_cast<std::uintptr_t>(reader_(tensors_[i].ptr())) != addresses_[i]) return false;
      } catch (...) {
        return false;
      }
    }
    return true;
  }

 private:
  AddressReader reader_;
  std::vector<nb::object> tensors_;
  std::vector<std::uintptr_t> addresses_;
};

}  // namespace

void register_tensor_addresses(nb::module_& m) {
  nb::class_<TensorAddresses>(m, "TensorAddresses",
                              "Tensors and the addresses they have now (read through `reader`, torch's "
                              "_torchinductor_pyobject_tensor_data_ptr); unchanged() says whether each still has it.")
      .def(nb::init<std::uintptr_t, std::vector<nb::object>>(), nb::arg("reader"), nb::arg("tensors"))
      .def_prop_ro("addresses", &TensorAddresses::addresses, "The addresses as read when made, in order.")
      .def("unchanged", &TensorAddresses::unchanged,
           "Whether every tensor is at the address it had when this was made.");

  m.def(
      "tensor_addresses",
      [](std::uintptr_t reader, const std::vector<nb::object>& tensors) {
        return read_addresses(as_reader(reader), tensors);
      },
      nb::arg("reader"), nb::arg("tensors"), "Each tensor's data_ptr(), in order, read through `reader`.");
}

}  // namespace graphsafe::bindings
