// The mapped pinned host record that kernels write their input errors into (see graphsafe/errors.h).
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
  // Portable: valid from every device; mapped: kernels write it directly, so the host can read it
  // without a device-to-host copy (and without a synchronisation).
  GS_CUDA_CHECK(cudaHostAlloc(&host, sizeof(DeviceErrorRecord), cudaHostAllocMapped | cudaHostAllocPortable));
  void* device = nullptr;
  GS_CUDA_CHECK(cudaHostGetDevicePointer(&device, host, 0));
  host_record = static_cast<DeviceErrorRecord*>(host);
  *host_record = DeviceErrorRecord{0, 0, 0};
  device_view = static_cast<DeviceErrorRecord*>(device);
}
}  // namespace

DeviceErrorRecord* device_error_record() {
  ensure_record();
  return device_view;
}

std::string take_device_error(bool clear) {
  if (!host_record) return {};
  volatile DeviceErrorRecord* record = host_record;
  const auto code = static_cast<DeviceErrorCode>(record->code);
  if (code == DeviceErrorCode::None) return {};
  std::string message;
  if (code == DeviceErrorCode::IndexOutOfRange)
    message = "index " + std::to_string(record->bad_value) + " is out of range for an embedding with " +
              std::to_string(record->upper_bound) +
              " rows (found on the GPU and left out: a lookup gave a zero row, a gradient skipped it)";
  else
    message = "graphsafe device error code " + std::to_string(static_cast<int64_t>(code));
  if (clear) record->code = 0;
  return message;
}

}  // namespace graphsafe
