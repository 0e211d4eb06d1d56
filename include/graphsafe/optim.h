// Optimizer steps with fp32, bf16 or 8-bit states for the algorithms of graphsafe/optim_algorithms.h, on many
// tensors at once, without host syncs.
//
// Every update rule is written once (src/optim/rules.h) and shared by the CPU and CUDA backends. The
// learning rate and the step counter are read from memory at run time (device memory on CUDA), so a step
// captured in a CUDA graph follows an LR scheduler that updates that memory between replays. The other
// hyperparameters are constants of a call (a captured graph keeps the values it was captured with).
//
// The learning rate must be >= 0 (+inf included, as torch allows); a NaN or negative one, which a scheduler or a
// user may write into that memory at any time, is refused and the step changes nothing (no parameter, state or
// step count): the CPU step throws std::invalid_argument before it writes anything; the CUDA step, which never
// reads device memory on the host, has every kernel of the step read it, write nothing when it is invalid, and
// record the error (OptimStepArgs::error) for the host to raise later.
//
// skip_zeros: where the raw gradient element is exactly zero (-0.0 included; NaN is not zero) the
// parameter and all its states stay bit-identical: no weight decay, no momentum decay.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

#include "graphsafe/optim_algorithms.h"
#include "graphsafe/types.h"

namespace graphsafe {

struct DeviceErrorRecord;  // graphsafe/errors.h

// Hyperparameters are doubles, like torch's Python floats: derived constants (1 - beta, lr * weight_decay,
// bias corrections) are formed in double and rounded to fp32 once, as torch does. Schedule-Free AdamW's three are
// fp32 (a step count and two powers; formed into its constants in double all the same): every CUDA kernel takes
// OptimOptions by value, and past 128 bytes nvcc compiles the kernels' reads of it differently and the 8-bit LAMB
// step slowed down (docs/benchmarks.md, the optim run of 2026-12-02); the three fit in the padding.
struct OptimOptions {
  OptimAlgorithm algorithm = OptimAlgorithm::Adam;
  float warmup_steps = 0.0f;   // Schedule-Free AdamW: linear lr warm-up length (0: none)
  double beta1 = 0.9;          // Adam/AdamW/LAMB/AdEMAMix/Lion first beta
  double beta2 = 0.999;        // second-moment beta (Lion: the momentum-update beta)
  double beta3 = 0.9999;       // AdEMAMix slow-EMA beta (final value)
  double eps = 1e-8;
  double weight_decay = 0.0;
  double momentum = 0.0;       // SGD, RMSprop, LARS
  double dampening = 0.0;      // SGD
  double alpha = 0.99;         // RMSprop smoothing constant
  double lr_decay = 0.0;       // Adagrad
  double mix_alpha = 5.0;      // AdEMAMix alpha (final value)
  double alpha_warmup = 0.0;   // AdEMAMix T_alpha (0: no warm-up)
  double beta3_warmup = 0.0;   // AdEMAMix T_beta3 (0: no warm-up)
  double trust_coefficient = 0.001;  // LARS eta
  bool amsgrad = false;        // Adam/AdamW
  bool maximize = false;
  bool nesterov = false;       // SGD
  bool centered = false;       // RMSprop
  bool bias_correction = true; // LAMB
  bool skip_zeros = false;
  float r = 0.0f;                // Schedule-Free AdamW: the average's weights grow as step^r
  float weight_lr_power = 2.0f;  // Schedule-Free AdamW: ... and as lr_max^weight_lr_power
};
static_assert(sizeof(OptimOptions) <= 128, "OptimOptions stays within 128 bytes (see above)");

// One parameter tensor of a step. With 32-bit states, `state` holds optim_state_count(options) fp32 buffers
// of `numel`; with 16-bit states, as many bf16 buffers; with 8-bit states, `codes` holds as many uint8
// buffers of `numel` and `absmax` fp32 buffers of ceil(numel / block_size) (see quantize_blockwise).
struct OptimTensor {
  void* param = nullptr;        // param dtype
  const void* grad = nullptr;   // same dtype as the parameter
  void* state[kMaxOptimStates] = {};  // fp32 (state_bits 32) or bf16 (16)
  uint8_t* codes[kMaxOptimStates] = {};
  float* absmax[kMaxOptimStates] = {};
  float* step = nullptr;  // this parameter's step number: 1 on its first step (see OptimStepArgs::increment_steps)
  // The algorithm's optim_schedule_size schedule values (graphsafe/optim_algorithms.h), one float64 each; the
  // step advances them once, whether or not it counts the step.
  double* schedule[kMaxScheduleValues] = {};
  int64_t numel = 0;
};

struct OptimStepArgs {
  OptimOptions options;
  DType param_dtype = DType::Float32;  // Float32, Float16 or BFloat16 (params and grads)
  const float* lr = nullptr;           // one float: the learning rate (>= 0, see the top of this file)
  // CUDA: the record (graphsafe/errors.h, device_error_record()) in which the kernels report a NaN or negative
  // learning rate; null: not reported (the step still writes nothing then). The CPU step throws instead.
  DeviceErrorRecord* error = nullptr;
  // Add 1 to every tensor's step before the update (true: the step saves the caller a launch; false: the
  // caller has incremented them).
  bool increment_steps = false;
  // CUDA, with increment_steps: a uint32 in device memory, 0, that the element-wise update kernels count their
  // finished blocks in, so that the last block adds the 1 to the steps (the update reads each step and adds 1
  // itself) instead of a launch of its own ahead of the update; it is 0 again after the step. One per stream
  // that steps may run on at the same time (an optimizer's steps run in order on one). Null, and for LAMB and
  // LARS: the launch ahead.
  uint32_t* finish_counter = nullptr;
  // 32: fp32 states; 16: bf16 states (the update computed in fp32 from them, its results rounded to nearest
  // even once, as torch's fused steps keep half parameters' states); 8: blockwise 8-bit states of block_size
  // elements (a power of two, 32 to 1024).
  int state_bits = 32;
  int block_size = 256;
  // LAMB and LARS on a sharded tensor (docs/optim.md, "LAMB and LARS on shards"): 2 floats per tensor, in the
  // tensors' order, each tensor's squared norms (param², update²) over the WHOLE tensor: the partials that
  // optim_layerwise_norms_* measured on every shard, summed across the shards by the caller in a fixed order. Host
  // memory on the CPU, device memory on CUDA. Set, the step forms each tensor's factor from these totals
  // (rules.h, layerwise_factor) instead of measuring its own; everything else (steps, skip_zeros, 8-bit states,
  // the lr test) is as without. Null: the step measures. Only for the layer-wise algorithms (std::invalid_argument
  // otherwise).
  const float* layerwise_norms = nullptr;
};

// The range an option must lie in (validate_optim_options): flags take any value.
enum class OptionRange : int8_t { Flag, Finite, NonNegative, Positive, UnitInterval /* [0, 1) */ };

// Every option an algorithm of the table may name: its name in the table and the bindings, the name an error
// message shows (the Python argument's), the OptimOptions field it sets (a double, a flag or an fp32 one) and its
// range. The option checks,
// set_optim_option and the bindings read this list; a compile-time check (src/optim/common.cpp) finds every
// option of kOptimAlgorithms here.
struct OptimOptionField {
  const char* name;
  const char* shown_as;
  double OptimOptions::*number;
  bool OptimOptions::*flag;
  OptionRange range;
  float OptimOptions::*single = nullptr;
};
inline constexpr OptimOptionField kOptimOptionFields[] = {
    {"beta1", "betas[0]", &OptimOptions::beta1, nullptr, OptionRange::UnitInterval},
    {"beta2", "betas[1]", &OptimOptions::beta2, nullptr, OptionRange::UnitInterval},
    {"beta3", "betas[2]", &OptimOptions::beta3, nullptr, OptionRange::UnitInterval},
    {"eps", "eps", &OptimOptions::eps, nullptr, OptionRange::NonNegative},
    {"weight_decay", "weight_decay", &OptimOptions::weight_decay, nullptr, OptionRange::NonNegative},
    {"momentum", "momentum", &OptimOptions::momentum, nullptr, OptionRange::NonNegative},
    {"dampening", "dampening", &OptimOptions::dampening, nullptr, OptionRange::Finite},
    {"alpha", "alpha", &OptimOptions::alpha, nullptr, OptionRange::NonNegative},
    {"lr_decay", "lr_decay", &OptimOptions::lr_decay, nullptr, OptionRange::NonNegative},
    {"mix_alpha", "alpha", &OptimOptions::mix_alpha, nullptr, OptionRange::NonNegative},
    {"alpha_warmup", "t_alpha", &OptimOptions::alpha_warmup, nullptr, OptionRange::NonNegative},
    {"beta3_warmup", "t_beta3", &OptimOptions::beta3_warmup, nullptr, OptionRange::NonNegative},
    {"trust_coefficient", "trust_coefficient", &OptimOptions::trust_coefficient, nullptr, OptionRange::Positive},
    {"warmup_steps", "warmup_steps", nullptr, nullptr, OptionRange::NonNegative, &OptimOptions::warmup_steps},
    {"r", "r", nullptr, nullptr, OptionRange::Finite, &OptimOptions::r},
    {"weight_lr_power", "weight_lr_power", nullptr, nullptr, OptionRange::NonNegative, &OptimOptions::weight_lr_power},
    {"amsgrad", "amsgrad", nullptr, &OptimOptions::amsgrad, OptionRange::Flag},
    {"maximize", "maximize", nullptr, &OptimOptions::maximize, OptionRange::Flag},
    {"nesterov", "nesterov", nullptr, &OptimOptions::nesterov, OptionRange::Flag},
    {"centered", "centered", nullptr, &OptimOptions::centered, OptionRange::Flag},
    {"bias_correction", "bias_correction", nullptr, &OptimOptions::bias_correction, OptionRange::Flag},
    {"skip_zeros", "skip_zeros", nullptr, &OptimOptions::skip_zeros, OptionRange::Flag},
};

// Whether a state of this presence exists under these options (graphsafe/optim_algorithms.h).
constexpr bool optim_state_present(const OptimOptions& o, StatePresence presence) {
  switch (presence) {
    case StatePresence::Always: return true;
    case StatePresence::IfAmsgrad: return o.amsgrad;
    case StatePresence::IfMomentumNonZero: return o.momentum != 0.0;
    case StatePresence::IfMomentumPositive: return o.momentum > 0.0;
    case StatePresence::IfCentered: return o.centered;
  }
  return false;
}

// Number of state buffers the algorithm keeps per parameter under these options: the table's states
// (graphsafe/optim_algorithms.h) that are present, in the table's order; state j of a step is the j-th of them.
constexpr int optim_state_count(const OptimOptions& o) {
  int n = 0;
  for (const OptimStateSpec& s : optim_algorithm_spec(o.algorithm).states)
    n += s.name != nullptr && optim_state_present(o, s.presence);
  return n;
}

// The table's entry of state j (0 <= j < optim_state_count(o)).
const OptimStateSpec& optim_state_spec(const OptimOptions& o, int j);

// The algorithm of a table name ("adamw"); std::invalid_argument for an unknown one.
OptimAlgorithm optim_algorithm_from_name(std::string_view name);

// Sets the option of this name (an OptimOptions field, by the name the table uses; a flag from a value != 0);
// std::invalid_argument for a name that is not one of o.algorithm's options, maximize or skip_zeros.
void set_optim_option(OptimOptions& o, std::string_view name, double value);

// Throws std::invalid_argument naming the first invalid hyperparameter.
void validate_optim_options(const OptimOptions& options);

// Scratch bytes for a step over `count` tensors of the given sizes (LAMB and LARS keep per-block norm
// partials and per-tensor trust ratios there, an algorithm with a schedule one float64 per tensor; the others
// need none). Depends on sizes only.
std::size_t optim_workspace_bytes(Backend backend, const OptimOptions& options, const int64_t* numels, int count);

void optim_step_cpu(const OptimStepArgs& args, const OptimTensor* tensors, int count, void* workspace,
                    std::size_t workspace_bytes);

// Throws std::invalid_argument unless *lr (host memory) is a usable learning rate: the check optim_step_cpu
// makes first, for a caller that steps several groups and refuses them all before stepping any.
void optim_check_learning_rate_cpu(const float* lr);

// Asynchronous on `stream`; all pointers (including lr and step) are device pointers. Tensors are
// processed in launches of many tensors each.
void optim_step_cuda(const OptimStepArgs& args, const OptimTensor* tensors, int count, void* workspace,
                     std::size_t workspace_bytes, StreamHandle stream);

// The first phase of a LAMB/LARS step on shards (OptimStepArgs::layerwise_norms): for each tensor, the squared
// norms (param², update²) that the step's measuring pass would add up, in the same order (src/optim/layout.h),
// written as 2 floats per tensor to `norms` (an empty tensor: 0, 0). The coefficients are the step's: step + 1
// with args.increment_steps (the steps are not incremented here), else the step as stored. Writes nothing else:
// no parameter, state or step (the workspace, of optim_workspace_bytes, holds the chunks' partials). The
// arguments are a step's (finish_counter and layerwise_norms are not read); only for the layer-wise algorithms
// (std::invalid_argument otherwise). An unusable learning rate is refused as by the step: the CPU throws before
// writing anything; on CUDA nothing is written and the error is recorded (OptimStepArgs::error).
void optim_layerwise_norms_cpu(const OptimStepArgs& args, const OptimTensor* tensors, int count, void* workspace,
                               std::size_t workspace_bytes, float* norms);
// Asynchronous on `stream` and capturable; device pointers (`norms` included); reads nothing on the host.
void optim_layerwise_norms_cuda(const OptimStepArgs& args, const OptimTensor* tensors, int count, void* workspace,
                                std::size_t workspace_bytes, float* norms, StreamHandle stream);

// ---- 8-bit blockwise quantisation (docs/optim.md "8-bit states") ----
//
// Blocks of block_size consecutive elements (a power of two, 32 to 1024) keep one fp32 absmax each and one
// code per element: value = map[code] * absmax. The signed map serves values of either sign (first
// moments), the unsigned map non-negative ones (second moments); both are 256 increasing values with 0 and
// 1 exact (and -1 in the signed one). Quantising rounds to the nearest map value (ties toward zero).

// The 256 values of a map (host memory).
const float* quantization_map(bool is_signed);

// Whether state j of the algorithm uses the signed map.
bool optim_state_is_signed(const OptimOptions& options, int j);

void quantize_blockwise_cpu(const float* x, int64_t numel, int block_size, bool is_signed, uint8_t* codes,
                            float* absmax);
void dequantize_blockwise_cpu(const uint8_t* codes, const float* absmax, int64_t numel, int block_size,
                              bool is_signed, float* out);
// Asynchronous on `stream`; device pointers.
void quantize_blockwise_cuda(const float* x, int64_t numel, int block_size, bool is_signed, uint8_t* codes,
                             float* absmax, StreamHandle stream);
void dequantize_blockwise_cuda(const uint8_t* codes, const float* absmax, int64_t numel, int block_size,
                               bool is_signed, float* out, StreamHandle stream);

}  // namespace graphsafe
