// The mapped pinned host record that kernels write their input errors into (see graphsafe/errors.h).
#include <cstdio>
#include <cstring>
#include <mutex>
#include <string>

#include "common/cuda_check.h"
#include "graphsafe/errors.h"
#include "graphsafe/types.h"

namespace graphsafe {

bool cuda_backend_available() { return true; }

namespace {
DeviceErrorRecord* host_record = nullptr;
DeviceErrorRecord* device_view = nullptr;
std::mutex record_mutex;

void ensure_record() {
  std::lock_guard<std::mutex> lock(record_mutex);
  if (host_record) return;
  void* host = nullptr;
  void* device = nullptr;
  // The first graphsafe CUDA call may come while a CUDA graph is being captured (global capture mode
  // forbids allocations); relaxed mode lets this one-time host allocation through.
  cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
  GS_CUDA_CHECK(cudaThreadExchangeStreamCaptureMode(&mode));
  // Portable: valid from every device; mapped: kernels write it directly, so the host can read it
  // without a device-to-host copy (and without a synchronisation).
  cudaError_t status = cudaHostAlloc(&host, sizeof(DeviceErrorRecord), cudaHostAllocMapped | cudaHostAllocPortable);
  if (status == cudaSuccess) status = cudaHostGetDevicePointer(&device, host, 0);
  cudaThreadExchangeStreamCaptureMode(&mode);
  GS_CUDA_CHECK(status);
  host_record = static_cast<DeviceErrorRecord*>(host);
  *host_record = DeviceErrorRecord{0, 0, 0};
  device_view = static_cast<DeviceErrorRecord*>(device);
}

// The message of DeviceErrorCode::InvalidLearningRate; the Python layer keys its ValueError on the first words.
std::string invalid_learning_rate_message(uint32_t lr_bits) {
  float lr = 0.0f;
  std::memcpy(&lr, &lr_bits, sizeof(lr));
  char value[32];
  std::snprintf(value, sizeof(value), "%g", static_cast<double>(lr));
  return std::string("invalid learning rate ") + value +
         " in an optimizer's lr tensor (it must be >= 0), found on the GPU: that optimizer step changed no "
         "parameter, state or step count";
}
}  // namespace

DeviceErrorRecord* device_error_record() {
  ensure_record();
  return device_view;
}

std::string take_device_error(bool clear) {
  if (!host_record) return {};
  volatile DeviceErrorRecord* record = host_record;
  // Taking the code atomically: an error a kernel records between our read and our reset is not lost.
  const auto code = static_cast<DeviceErrorCode>(
      clear ? __atomic_exchange_n(&host_record->code, int64_t{0}, __ATOMIC_ACQ_REL)
            : __atomic_load_n(&host_record->code, __ATOMIC_ACQUIRE));
  if (code == DeviceErrorCode::None) return {};
  std::string message;
  if (code == DeviceErrorCode::IndexOutOfRange)
    message = "index " + std::to_string(record->bad_value) + " is out of range for an embedding with " +
              std::to_string(record->upper_bound) +
              " rows (found on the GPU and left out: a lookup gave a zero row, a gradient skipped it)";
  else if (code == DeviceErrorCode::InvalidLearningRate)
    message = invalid_learning_rate_message(static_cast<uint32_t>(record->bad_value));
  else
    message = "graphsafe device error code " + std::to_string(static_cast<int64_t>(code));
  return message;
}

}  // namespace graphsafe
