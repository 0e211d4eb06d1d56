// Device side of the error record in graphsafe/errors.h.
#pragma once

#include "graphsafe/errors.h"

namespace graphsafe {

// Plain stores, no atomics on host memory: when several threads fail at once one of their values
// survives, which is all the message needs.
__device__ inline void report_index_out_of_range(DeviceErrorRecord* error, int64_t value, int64_t bound) {
  volatile DeviceErrorRecord* record = error;
  record->bad_value = value;
  record->upper_bound = bound;
  __threadfence_system();  // the details land before the code that announces them
  record->code = static_cast<int64_t>(DeviceErrorCode::IndexOutOfRange);
}

// An optimizer step whose learning rate (read from device memory) is NaN or negative: the step wrote nothing.
__device__ inline void report_invalid_learning_rate(DeviceErrorRecord* error, float lr) {
  volatile DeviceErrorRecord* record = error;
  record->bad_value = static_cast<int64_t>(__float_as_uint(lr));
  record->upper_bound = 0;
  __threadfence_system();
  record->code = static_cast<int64_t>(DeviceErrorCode::InvalidLearningRate);
}

}  // namespace graphsafe
