// Errors that CUDA kernels report without a host synchronisation.
//
// A kernel that meets bad input it cannot reject up front (an out-of-range index read from device memory, an
// optimizer's learning rate that an LR scheduler wrote into device memory) must neither write out of bounds
// nor stop the process. It records the problem in a small buffer of mapped, pinned host memory and carries on
// with the valid part of the input (an optimizer step with an invalid learning rate writes nothing). The host reads the buffer
// whenever it likes (after a synchronisation the value is final); reading it never synchronises by itself.
#pragma once

#include <cstdint>
#include <string>

namespace graphsafe {

enum class DeviceErrorCode : int64_t { None = 0, IndexOutOfRange = 1, InvalidLearningRate = 2 };

// Layout shared by host and device. Written by kernels with plain stores (no atomics on host memory):
// when several threads fail at once, one of their offending values survives, which is all a message needs.
struct DeviceErrorRecord {
  int64_t code;         // DeviceErrorCode
  int64_t bad_value;    // the offending index; InvalidLearningRate: the learning rate's float bits
  int64_t upper_bound;  // the exclusive bound it violated (num_weights); InvalidLearningRate: 0
};

// The process-wide record, allocated on first use as mapped pinned host memory (not device memory).
// Returns the device-side pointer to pass to kernels. Throws std::runtime_error without a CUDA backend.
DeviceErrorRecord* device_error_record();

// Reads the record without synchronising. Returns an empty string when no error was recorded, else a
// message naming the problem (InvalidLearningRate's starts with "invalid learning rate", which the Python
// layer turns into a ValueError; IndexOutOfRange's into an IndexError). With clear=true the record is reset after reading.
std::string take_device_error(bool clear);

}  // namespace graphsafe
