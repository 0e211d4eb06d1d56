// nanobind module graphsafe._C: the boundary between Python and the C++ core.
//
// Tensors arrive as raw addresses plus dtype names and shapes: the Python layer (which owns every tensor
// and allocation, through torch) has already checked devices, contiguity and shapes; here the dtype names
// are parsed and the core re-checks everything it relies on. Passing addresses rather than DLPack capsules
// keeps the call free of stream synchronisation, so it stays legal while a CUDA graph is being captured.
// C++ exceptions become Python exceptions: invalid_argument -> ValueError, out_of_range -> IndexError,
// runtime_error -> RuntimeError.
#include <nanobind/nanobind.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#if defined(GRAPHSAFE_WITH_CUDA)
#include <cuda_runtime.h>
#endif

#include "graphsafe/embedding.h"
#include "graphsafe/errors.h"
#include "graphsafe/optim.h"
#include "graphsafe/optim_sparse.h"
#include "graphsafe/types.h"

#include "bindings/tensor_addresses.h"

namespace nb = nanobind;
using namespace graphsafe;

namespace {

Backend backend_from_name(const std::string& device_type) {
  if (device_type == "cpu") return Backend::Cpu;
  if (device_type == "cuda") return Backend::Cuda;
  throw std::invalid_argument("graphsafe supports cpu and cuda tensors, got device type '" + device_type + "'");
}

// Runs `body` with `device_index` as the current CUDA device and restores the previous one.
template <class Body>
void on_device(int device_index, Body&& body) {
#if defined(GRAPHSAFE_WITH_CUDA)
  int previous = 0;
  if (cudaGetDevice(&previous) != cudaSuccess) throw std::runtime_error("cudaGetDevice failed");
  if (previous != device_index && cudaSetDevice(device_index) != cudaSuccess)
    throw std::runtime_error("cudaSetDevice failed for device " + std::to_string(device_index));
  try {
    body();
  } catch (...) {
    if (previous != device_index) cudaSetDevice(previous);
    throw;
  }
  if (previous != device_index) cudaSetDevice(previous);
#else
  (void)device_index;
  body();
#endif
}

// Runs `cpu` without the GIL (it may take long and never calls Python) for device type "cpu", or `cuda` with
// the caller's device current for "cuda".
template <class Cpu, class Cuda>
void run_on(const std::string& device_type, int device_index, Cpu&& cpu, Cuda&& cuda) {
  if (backend_from_name(device_type) == Backend::Cpu) {
    nb::gil_scoped_release release;
    cpu();
    return;
  }
  on_device(device_index, cuda);
}

void* as_pointer(std::uintptr_t address) { return reinterpret_cast<void*>(address); }

// Options arrive as a {name: number} map (booleans as 0/1) so Python can name only what it sets; the names and
// which algorithm takes which are the table's (graphsafe/optim_algorithms.h).
OptimOptions optim_options(const std::string& algorithm, const std::map<std::string, double>& values) {
  OptimOptions o;
  o.algorithm = optim_algorithm_from_name(algorithm);
  for (const auto& [key, v] : values) set_optim_option(o, key, v);
  return o;
}

// The arguments optim_step and optim_layerwise_norms share, with the options parsed.
OptimStepArgs optim_step_args(const std::string& algorithm, const std::map<std::string, double>& options,
                              const std::string& param_dtype, std::uintptr_t lr, bool increment_steps, int state_bits,
                              int block_size) {
  OptimStepArgs args;
  args.options = optim_options(algorithm, options);
  args.param_dtype = dtype_from_name(param_dtype);
  args.lr = static_cast<const float*>(as_pointer(lr));
  args.increment_steps = increment_steps;
  args.state_bits = state_bits;
  args.block_size = block_size;
  return args;
}

// The tensors of a step from the per-tensor address lists (`what` names the call in errors): states and absmax
// state by state (state j of tensor t at j * count + t), schedule values likewise.
std::vector<OptimTensor> optim_tensors(const char* what, const OptimStepArgs& args,
                                       const std::vector<std::uintptr_t>& params,
                                       const std::vector<std::uintptr_t>& grads,
                                       const std::vector<std::uintptr_t>& states,
                                       const std::vector<std::uintptr_t>& absmax,
                                       const std::vector<std::uintptr_t>& steps, const std::vector<int64_t>& numels,
                                       const std::vector<std::uintptr_t>& schedule) {
  const std::size_t count = params.size();
  const std::string name = what;
  if (grads.size() != count || steps.size() != count || numels.size() != count)
    throw std::invalid_argument(name + ": params, grads, steps and numels differ in length");
  const std::size_t state_count = static_cast<std::size_t>(optim_state_count(args.options));
  if (states.size() != state_count * count)
    throw std::invalid_argument(name + ": " + std::to_string(states.size()) + " state addresses for " +
                                std::to_string(count) + " tensors of an algorithm that keeps " +
                                std::to_string(state_count) + " states each");
  if (absmax.size() != (args.state_bits == 8 ? state_count * count : 0))
    throw std::invalid_argument(name + ": 8-bit states need one absmax address per state and tensor, "
                                "fp32 and bf16 states none; got " + std::to_string(absmax.size()));
  const std::size_t schedule_size = static_cast<std::size_t>(optim_schedule_size(args.options.algorithm));
  if (schedule.size() != schedule_size * count)
    throw std::invalid_argument(name + ": " + std::to_string(schedule.size()) + " schedule addresses for " +
                                std::to_string(count) + " tensors of an algorithm that keeps " +
                                std::to_string(schedule_size) + " schedule values each");
  std::vector<OptimTensor> tensors(count);
  for (std::size_t t = 0; t < count; ++t) {
    tensors[t].param = as_pointer(params[t]);
    tensors[t].grad = as_pointer(grads[t]);
    for (std::size_t j = 0; j < state_count; ++j) {
      void* state = as_pointer(states[j * count + t]);
      if (args.state_bits == 8) {
        tensors[t].codes[j] = static_cast<uint8_t*>(state);
        tensors[t].absmax[j] = static_cast<float*>(as_pointer(absmax[j * count + t]));
      } else {
        tensors[t].state[j] = state;
      }
    }
    tensors[t].step = static_cast<float*>(as_pointer(steps[t]));
    for (std::size_t j = 0; j < schedule_size; ++j)
      tensors[t].schedule[j] = static_cast<double*>(as_pointer(schedule[j * count + t]));
    tensors[t].numel = numels[t];
  }
  return tensors;
}

const char* presence_name(StatePresence presence) {
  switch (presence) {
    case StatePresence::Always: return "always";
    case StatePresence::IfAmsgrad: return "amsgrad";
    case StatePresence::IfMomentumNonZero: return "momentum != 0";
    case StatePresence::IfMomentumPositive: return "momentum > 0";
    case StatePresence::IfCentered: return "centered";
  }
  return "?";
}

// The table as Python sees it: {name: {"layerwise": bool, "options": [...], "states": [{"name", "signed",
// "present_when", "storage_bits": [...], "init": "zero" | "param"}, ...], "schedule": [...]}}.
nb::dict optim_algorithm_table() {
  nb::dict table;
  for (const OptimAlgorithmSpec& spec : kOptimAlgorithms) {
    nb::list options, states;
    for (const char* option : spec.options)
      if (option != nullptr) options.append(option);
    for (const OptimStateSpec& state : spec.states) {
      if (state.name == nullptr) continue;
      nb::list bits;
      for (int b : {32, 16, 8})
        if (state.storage & (b == 32 ? kStorage32 : b == 16 ? kStorage16 : kStorage8)) bits.append(b);
      nb::dict entry;
      entry["name"] = state.name;
      entry["signed"] = state.is_signed;
      entry["present_when"] = presence_name(state.presence);
      entry["storage_bits"] = bits;
      entry["init"] = state.init == StateInit::Param ? "param" : "zero";
      states.append(entry);
    }
    nb::list schedule;
    for (const char* name : spec.schedule)
      if (name != nullptr) schedule.append(name);
    nb::dict entry;
    entry["layerwise"] = spec.layerwise;
    entry["options"] = options;
    entry["states"] = states;
    entry["schedule"] = schedule;
    table[spec.name] = entry;
  }
  return table;
}

}  // namespace

NB_MODULE(_C, m) {
  m.doc() = "graphsafe C++ core (internal; use graphsafe.ops)";

  m.def("cuda_available", &cuda_backend_available, "True when the core was built with its CUDA backend.");

  m.def(
      "embedding_backward_workspace_bytes",
      [](const std::string& device_type, int device_index, const std::string& grad_dtype, int64_t num_indices,
         int64_t dim, int64_t num_weights) {
        const Backend backend = backend_from_name(device_type);
        std::size_t bytes = 0;
        // The sort's scratch depends on the GPU it runs on: ask on the tensor's device.
        auto query = [&] {
          bytes = embedding_backward_workspace_bytes(backend, dtype_from_name(grad_dtype), num_indices, dim, num_weights);
        };
        if (backend == Backend::Cpu) query(); else on_device(device_index, query);
        return bytes;
      },
      nb::arg("device_type"), nb::arg("device_index"), nb::arg("grad_dtype"), nb::arg("num_indices"), nb::arg("dim"),
      nb::arg("num_weights"));

  m.def(
      "embedding_backward_dense",
      [](const std::string& device_type, int device_index, std::uintptr_t stream, std::uintptr_t out,
         std::uintptr_t grad, const std::string& grad_dtype, std::uintptr_t indices, const std::string& index_dtype,
         int64_t num_indices, int64_t dim, int64_t num_weights, int64_t padding_idx, bool scale_grad_by_freq,
         std::uintptr_t workspace, std::size_t workspace_bytes) {
        EmbeddingBackwardArgs args;
        args.grad = as_pointer(grad);
        args.grad_dtype = dtype_from_name(grad_dtype);
        args.indices = as_pointer(indices);
        args.index_dtype = dtype_from_name(index_dtype);
        args.num_indices = num_indices;
        args.dim = dim;
        args.num_weights = num_weights;
        args.padding_idx = padding_idx;
        args.scale_grad_by_freq = scale_grad_by_freq;
        run_on(
            device_type, device_index,
            [&] { embedding_backward_dense_cpu(args, as_pointer(out), as_pointer(workspace), workspace_bytes); },
            [&] {
              embedding_backward_dense_cuda(args, as_pointer(out), as_pointer(workspace), workspace_bytes,
                                            device_error_record(), reinterpret_cast<StreamHandle>(stream));
            });
      },
      nb::arg("device_type"), nb::arg("device_index"), nb::arg("stream"), nb::arg("out"), nb::arg("grad"),
      nb::arg("grad_dtype"), nb::arg("indices"), nb::arg("index_dtype"), nb::arg("num_indices"), nb::arg("dim"),
      nb::arg("num_weights"), nb::arg("padding_idx"), nb::arg("scale_grad_by_freq"), nb::arg("workspace"),
      nb::arg("workspace_bytes"));

  m.def(
      "embedding_backward_sparse_workspace_bytes",
      [](const std::string& device_type, int device_index, const std::string& grad_dtype, int64_t num_indices,
         int64_t dim, int64_t num_weights) {
        const Backend backend = backend_from_name(device_type);
        std::size_t bytes = 0;
        // The sort's and the prefix sum's scratch depend on the GPU they run on: ask on the tensor's device.
        auto query = [&] {
          bytes = embedding_backward_sparse_workspace_bytes(backend, dtype_from_name(grad_dtype), num_indices, dim,
                                                            num_weights);
        };
        if (backend == Backend::Cpu) query(); else on_device(device_index, query);
        return bytes;
      },
      nb::arg("device_type"), nb::arg("device_index"), nb::arg("grad_dtype"), nb::arg("num_indices"), nb::arg("dim"),
      nb::arg("num_weights"));

  m.def(
      "embedding_backward_sparse",
      [](const std::string& device_type, int device_index, std::uintptr_t stream, std::uintptr_t rows,
         std::uintptr_t row_grads, std::uintptr_t count, std::uintptr_t grad, const std::string& grad_dtype,
         std::uintptr_t indices, const std::string& index_dtype, int64_t num_indices, int64_t dim,
         int64_t num_weights, int64_t padding_idx, bool scale_grad_by_freq, std::uintptr_t workspace,
         std::size_t workspace_bytes) {
        EmbeddingBackwardArgs args;
        args.grad = as_pointer(grad);
        args.grad_dtype = dtype_from_name(grad_dtype);
        args.indices = as_pointer(indices);
        args.index_dtype = dtype_from_name(index_dtype);
        args.num_indices = num_indices;
        args.dim = dim;
        args.num_weights = num_weights;
        args.padding_idx = padding_idx;
        args.scale_grad_by_freq = scale_grad_by_freq;
        auto* rows_out = static_cast<int64_t*>(as_pointer(rows));
        auto* count_out = static_cast<int64_t*>(as_pointer(count));
        run_on(
            device_type, device_index,
            [&] {
              embedding_backward_sparse_cpu(args, rows_out, as_pointer(row_grads), count_out, as_pointer(workspace),
                                            workspace_bytes);
            },
            [&] {
              embedding_backward_sparse_cuda(args, rows_out, as_pointer(row_grads), count_out, as_pointer(workspace),
                                             workspace_bytes, device_error_record(),
                                             reinterpret_cast<StreamHandle>(stream));
            });
      },
      nb::arg("device_type"), nb::arg("device_index"), nb::arg("stream"), nb::arg("rows"), nb::arg("row_grads"),
      nb::arg("count"), nb::arg("grad"), nb::arg("grad_dtype"), nb::arg("indices"), nb::arg("index_dtype"),
      nb::arg("num_indices"), nb::arg("dim"), nb::arg("num_weights"), nb::arg("padding_idx"),
      nb::arg("scale_grad_by_freq"), nb::arg("workspace"), nb::arg("workspace_bytes"));

  m.def(
      "embedding_lookup",
      [](const std::string& device_type, int device_index, std::uintptr_t stream, std::uintptr_t out,
         std::uintptr_t weight, std::size_t element_bytes, std::uintptr_t indices, const std::string& index_dtype,
         int64_t num_indices, int64_t dim, int64_t num_weights) {
        EmbeddingLookupArgs args;
        args.weight = as_pointer(weight);
        args.element_bytes = element_bytes;
        args.indices = as_pointer(indices);
        args.index_dtype = dtype_from_name(index_dtype);
        args.num_indices = num_indices;
        args.dim = dim;
        args.num_weights = num_weights;
        run_on(
            device_type, device_index, [&] { embedding_lookup_cpu(args, as_pointer(out)); },
            [&] {
              embedding_lookup_cuda(args, as_pointer(out), device_error_record(),
                                    reinterpret_cast<StreamHandle>(stream));
            });
      },
      nb::arg("device_type"), nb::arg("device_index"), nb::arg("stream"), nb::arg("out"), nb::arg("weight"),
      nb::arg("element_bytes"), nb::arg("indices"), nb::arg("index_dtype"), nb::arg("num_indices"), nb::arg("dim"),
      nb::arg("num_weights"));

  m.def(
      "optim_algorithms", &optim_algorithm_table,
      "The algorithm table (graphsafe/optim_algorithms.h): per name, layer-wise or not, its options and its "
      "states (name, signed map, when present, storage widths).");

  m.def(
      "optim_check_learning_rates",
      [](const std::vector<std::uintptr_t>& lrs) {
        for (std::uintptr_t lr : lrs) optim_check_learning_rate_cpu(static_cast<const float*>(as_pointer(lr)));
      },
      nb::arg("lrs"),
      "ValueError unless every float32 at these CPU addresses (the groups' lr tensors) is a usable learning rate.");

  m.def(
      "optim_state_names",
      [](const std::string& algorithm, const std::map<std::string, double>& options) {
        const OptimOptions o = optim_options(algorithm, options);
        std::vector<std::string> names;
        for (int j = 0; j < optim_state_count(o); ++j) names.emplace_back(optim_state_spec(o, j).name);
        return names;
      },
      nb::arg("algorithm"), nb::arg("options"), "The names of the states kept under these options, in order.");

  m.def(
      "optim_state_count",
      [](const std::string& algorithm, const std::map<std::string, double>& options) {
        return optim_state_count(optim_options(algorithm, options));
      },
      nb::arg("algorithm"), nb::arg("options"));

  m.def(
      "optim_validate",
      [](const std::string& algorithm, const std::map<std::string, double>& options) {
        validate_optim_options(optim_options(algorithm, options));
      },
      nb::arg("algorithm"), nb::arg("options"), "Raises ValueError naming the first invalid hyperparameter.");

  m.def(
      "optim_workspace_bytes",
      [](const std::string& device_type, const std::string& algorithm, const std::map<std::string, double>& options,
         const std::vector<int64_t>& numels) {
        return optim_workspace_bytes(backend_from_name(device_type), optim_options(algorithm, options), numels.data(),
                                     static_cast<int>(numels.size()));
      },
      nb::arg("device_type"), nb::arg("algorithm"), nb::arg("options"), nb::arg("numels"));

  m.def(
      "optim_step",
      [](const std::string& device_type, int device_index, std::uintptr_t stream, const std::string& algorithm,
         const std::map<std::string, double>& options, const std::string& param_dtype, std::uintptr_t lr,
         const std::vector<std::uintptr_t>& params, const std::vector<std::uintptr_t>& grads,
         const std::vector<std::uintptr_t>& states, const std::vector<std::uintptr_t>& absmax,
         const std::vector<std::uintptr_t>& steps, const std::vector<int64_t>& numels, std::uintptr_t workspace,
         std::size_t workspace_bytes, bool increment_steps, int state_bits, int block_size,
         std::uintptr_t finish_counter, const std::vector<std::uintptr_t>& schedule, std::uintptr_t layerwise_norms) {
        OptimStepArgs args =
            optim_step_args(algorithm, options, param_dtype, lr, increment_steps, state_bits, block_size);
        args.finish_counter = static_cast<uint32_t*>(as_pointer(finish_counter));
        args.layerwise_norms = static_cast<const float*>(as_pointer(layerwise_norms));
        const std::vector<OptimTensor> tensors =
            optim_tensors("optim_step", args, params, grads, states, absmax, steps, numels, schedule);
        const int count = static_cast<int>(tensors.size());
        run_on(
            device_type, device_index,
            [&] { optim_step_cpu(args, tensors.data(), count, as_pointer(workspace), workspace_bytes); },
            [&] {
              args.error = device_error_record();  // a NaN or negative lr found by the kernels is reported there
              optim_step_cuda(args, tensors.data(), count, as_pointer(workspace), workspace_bytes,
                              reinterpret_cast<StreamHandle>(stream));
            });
      },
      nb::arg("device_type"), nb::arg("device_index"), nb::arg("stream"), nb::arg("algorithm"), nb::arg("options"),
      nb::arg("param_dtype"), nb::arg("lr"), nb::arg("params"), nb::arg("grads"), nb::arg("states"),
      nb::arg("absmax"), nb::arg("steps"), nb::arg("numels"), nb::arg("workspace"), nb::arg("workspace_bytes"),
      nb::arg("increment_steps"), nb::arg("state_bits"), nb::arg("block_size"), nb::arg("finish_counter"),
      nb::arg("schedule") = std::vector<std::uintptr_t>{}, nb::arg("layerwise_norms") = std::uintptr_t{0},
      "states: the fp32 state addresses (bf16 with state_bits=16), or with state_bits=8 the codes' (uint8), state "
      "by state: state j of tensor t at j * len(params) + t; absmax the same for the 8-bit scales (empty for fp32 "
      "and bf16 states). "
      "finish_counter: CUDA, the address of a zeroed uint32 (OptimStepArgs::finish_counter), or 0. "
      "schedule: the float64 schedule values' addresses (OptimTensor::schedule), value j of tensor t at "
      "j * len(params) + t. "
      "layerwise_norms: LAMB/LARS on shards, the address of 2 float32 per tensor (param², update² of the whole "
      "tensor, the shards' optim_layerwise_norms summed in a fixed order), on the params' device; the step forms "
      "its factors from them instead of measuring. 0: none (the step measures).");

  m.def(
      "optim_layerwise_norms",
      [](const std::string& device_type, int device_index, std::uintptr_t stream, const std::string& algorithm,
         const std::map<std::string, double>& options, const std::string& param_dtype, std::uintptr_t lr,
         const std::vector<std::uintptr_t>& params, const std::vector<std::uintptr_t>& grads,
         const std::vector<std::uintptr_t>& states, const std::vector<std::uintptr_t>& absmax,
         const std::vector<std::uintptr_t>& steps, const std::vector<int64_t>& numels, std::uintptr_t workspace,
         std::size_t workspace_bytes, bool increment_steps, int state_bits, int block_size, std::uintptr_t norms) {
        OptimStepArgs args =
            optim_step_args(algorithm, options, param_dtype, lr, increment_steps, state_bits, block_size);
        const std::vector<OptimTensor> tensors =
            optim_tensors("optim_layerwise_norms", args, params, grads, states, absmax, steps, numels, {});
        const int count = static_cast<int>(tensors.size());
        auto* out = static_cast<float*>(as_pointer(norms));
        run_on(
            device_type, device_index,
            [&] {
              optim_layerwise_norms_cpu(args, tensors.data(), count, as_pointer(workspace), workspace_bytes, out);
            },
            [&] {
              args.error = device_error_record();
              optim_layerwise_norms_cuda(args, tensors.data(), count, as_pointer(workspace), workspace_bytes, out,
                                         reinterpret_cast<StreamHandle>(stream));
            });
      },
      nb::arg("device_type"), nb::arg("device_index"), nb::arg("stream"), nb::arg("algorithm"), nb::arg("options"),
      nb::arg("param_dtype"), nb::arg("lr"), nb::arg("params"), nb::arg("grads"), nb::arg("states"),
      nb::arg("absmax"), nb::arg("steps"), nb::arg("numels"), nb::arg("workspace"), nb::arg("workspace_bytes"),
      nb::arg("increment_steps"), nb::arg("state_bits"), nb::arg("block_size"), nb::arg("norms"),
      "LAMB/LARS on shards, phase 1: writes each tensor's squared norms (param², update²: 2 float32 per tensor, in "
      "order) to the address `norms` on the params' device, as the step with the same arguments would measure them "
      "(with increment_steps, for step + 1; the steps are not changed), and nothing else. The arguments are "
      "optim_step's; workspace as optim_workspace_bytes asks. Sum the shards' norms in a fixed order and pass the "
      "totals' address to optim_step(layerwise_norms=...).");

  m.def(
      "optim_sparse_workspace_bytes",
      [](const std::string& device_type, const std::string& algorithm, const std::map<std::string, double>& options,
         const std::string& param_dtype, int64_t numel) {
        return optim_sparse_workspace_bytes(backend_from_name(device_type), optim_options(algorithm, options),
                                            dtype_from_name(param_dtype), numel);
      },
      nb::arg("device_type"), nb::arg("algorithm"), nb::arg("options"), nb::arg("param_dtype"), nb::arg("numel"));

  m.def(
      "optim_step_sparse",
      [](const std::string& device_type, int device_index, std::uintptr_t stream, const std::string& algorithm,
         const std::map<std::string, double>& options, const std::string& param_dtype, std::uintptr_t lr,
         std::uintptr_t param, const std::vector<std::uintptr_t>& states, const std::vector<std::uintptr_t>& absmax,
         std::uintptr_t step, int64_t numel, const std::vector<std::uintptr_t>& schedule, std::uintptr_t rows,
         std::uintptr_t row_grads, std::uintptr_t count, int64_t capacity, int64_t row_length,
         std::uintptr_t workspace, std::size_t workspace_bytes, int state_bits, int block_size) {
        const OptimStepArgs args =
            optim_step_args(algorithm, options, param_dtype, lr, /*increment_steps=*/true, state_bits, block_size);
        // The one tensor as optim_step takes it (no dense gradient: the sparse step never reads tensor.grad).
        const std::vector<OptimTensor> tensors =
            optim_tensors("optim_step_sparse", args, {param}, {0}, states, absmax, {step}, {numel}, schedule);
        OptimSparseGradient gradient;
        gradient.rows = static_cast<const int64_t*>(as_pointer(rows));
        gradient.row_grads = as_pointer(row_grads);
        gradient.count = static_cast<const int64_t*>(as_pointer(count));
        gradient.capacity = capacity;
        gradient.row_length = row_length;
        run_on(
            device_type, device_index,
            [&] { optim_step_sparse_cpu(args, tensors[0], gradient, as_pointer(workspace), workspace_bytes); },
            [&] {
              OptimStepArgs with_error = args;
              with_error.error = device_error_record();
              optim_step_sparse_cuda(with_error, tensors[0], gradient, as_pointer(workspace), workspace_bytes,
                                     reinterpret_cast<StreamHandle>(stream));
            });
      },
      nb::arg("device_type"), nb::arg("device_index"), nb::arg("stream"), nb::arg("algorithm"), nb::arg("options"),
      nb::arg("param_dtype"), nb::arg("lr"), nb::arg("param"), nb::arg("states"), nb::arg("absmax"), nb::arg("step"),
      nb::arg("numel"), nb::arg("schedule"), nb::arg("rows"), nb::arg("row_grads"), nb::arg("count"),
      nb::arg("capacity"), nb::arg("row_length"), nb::arg("workspace"), nb::arg("workspace_bytes"),
      nb::arg("state_bits"), nb::arg("block_size"),
      "The row-sparse step of one tensor (graphsafe/optim_sparse.h): as optim_step over it with the gradient that "
      "rows (int64, strictly increasing) and row_grads ([capacity, row_length], the param dtype) scatter into, of "
      "which the first *count (an int64 on the params' device) are used. skip_zeros must be on. states, absmax and "
      "schedule as optim_step's for one tensor; workspace as optim_sparse_workspace_bytes asks.");

  m.def(
      "quantization_map", [](bool is_signed) {
        const float* map = quantization_map(is_signed);
        return std::vector<float>(map, map + 256);
      },
      nb::arg("signed"), "The 256 values of the signed or unsigned 8-bit map, increasing.");

  m.def(
      "optim_state_is_signed",
      [](const std::string& algorithm, const std::map<std::string, double>& options, int j) {
        return optim_state_is_signed(optim_options(algorithm, options), j);
      },
      nb::arg("algorithm"), nb::arg("options"), nb::arg("j"));

  m.def(
      "quantize_blockwise",
      [](const std::string& device_type, int device_index, std::uintptr_t stream, std::uintptr_t x, int64_t numel,
         int block_size, bool is_signed, std::uintptr_t codes, std::uintptr_t absmax) {
        auto* in = static_cast<const float*>(as_pointer(x));
        auto* c = static_cast<uint8_t*>(as_pointer(codes));
        auto* a = static_cast<float*>(as_pointer(absmax));
        run_on(
            device_type, device_index, [&] { quantize_blockwise_cpu(in, numel, block_size, is_signed, c, a); },
            [&] {
              quantize_blockwise_cuda(in, numel, block_size, is_signed, c, a, reinterpret_cast<StreamHandle>(stream));
            });
      },
      nb::arg("device_type"), nb::arg("device_index"), nb::arg("stream"), nb::arg("x"), nb::arg("numel"),
      nb::arg("block_size"), nb::arg("signed"), nb::arg("codes"), nb::arg("absmax"));

  m.def(
      "dequantize_blockwise",
      [](const std::string& device_type, int device_index, std::uintptr_t stream, std::uintptr_t codes,
         std::uintptr_t absmax, int64_t numel, int block_size, bool is_signed, std::uintptr_t out) {
        auto* c = static_cast<const uint8_t*>(as_pointer(codes));
        auto* a = static_cast<const float*>(as_pointer(absmax));
        auto* o = static_cast<float*>(as_pointer(out));
        run_on(
            device_type, device_index, [&] { dequantize_blockwise_cpu(c, a, numel, block_size, is_signed, o); },
            [&] {
              dequantize_blockwise_cuda(c, a, numel, block_size, is_signed, o, reinterpret_cast<StreamHandle>(stream));
            });
      },
      nb::arg("device_type"), nb::arg("device_index"), nb::arg("stream"), nb::arg("codes"), nb::arg("absmax"),
      nb::arg("numel"), nb::arg("block_size"), nb::arg("signed"), nb::arg("out"));

  graphsafe::bindings::register_tensor_addresses(m);

  m.def("take_device_error", &take_device_error, nb::arg("clear") = true,
        "Message of the error a kernel recorded, or '' (reads mapped host memory; never synchronises).");
}
