// The one declaration of every optimizer algorithm: its name, the options it reads, its states (in the core's
// order, each with its signedness, when it exists, the storage widths it may take and how it starts), its
// per-tensor schedule values and whether it is layer-wise. The core's option checks and state counts, the bindings (names, option names, state names), the
// 8-bit maps' choice of signed or unsigned map and the Python classes' state names all read or are checked
// against this table (tests/cpp/test_optim_table.cpp checks the rest of the core against it at compile time).
//
// Adding an element-wise algorithm: an enumerator and a table entry here (and any new option: an OptimOptions
// field with its kOptimOptionFields entry, graphsafe/optim.h), its update rule in src/optim/rules.h (and its
// cases in the switches there: compile-time checks name a missing one), and a Python class in
// python/graphsafe/optim/algorithms.py (constructor, docstring, _options). docs/optim.md, "Adding an
// algorithm", lists the steps.
#pragma once

#include <cstddef>
#include <cstdint>

namespace graphsafe {

// In table order (kOptimAlgorithms[i].algorithm is enumerator i).
enum class OptimAlgorithm : int32_t { Adam, AdamW, SGD, RMSprop, Adagrad, Lion, LAMB, LARS, AdEMAMix, AdamWScheduleFree };

// How a state starts, on a parameter's first step: zeros, or a copy of the parameter (an iterate the
// algorithm keeps beside the parameter).
enum class StateInit : int8_t { Zero, Param };

// When a state exists, given the options (states an option turns off are not kept at all).
enum class StatePresence : int8_t {
  Always,
  IfAmsgrad,           // options.amsgrad
  IfMomentumNonZero,   // options.momentum != 0 (SGD, as torch keeps no buffer without momentum)
  IfMomentumPositive,  // options.momentum > 0 (RMSprop)
  IfCentered,          // options.centered
};

// Storage widths a state may take (OptimStepArgs::state_bits), as a mask of these bits.
inline constexpr uint8_t kStorage32 = 1, kStorage16 = 2, kStorage8 = 4;
inline constexpr uint8_t kAnyStorage = kStorage32 | kStorage16 | kStorage8;

struct OptimStateSpec {
  const char* name = nullptr;  // the state_dict key (torch.optim's name where torch has the algorithm)
  bool is_signed = true;       // 8-bit: the signed map (values of either sign) or the unsigned one (>= 0)
  StatePresence presence = StatePresence::Always;
  uint8_t storage = kAnyStorage;
  StateInit init = StateInit::Zero;
};

inline constexpr int kMaxOptimStates = 4;   // OptimTensor's state slots
inline constexpr int kMaxOptimOptions = 8;  // options of one algorithm, besides maximize and skip_zeros
inline constexpr int kMaxScheduleValues = 2;  // OptimTensor's schedule slots

struct OptimAlgorithmSpec {
  OptimAlgorithm algorithm;
  const char* name;  // the name the bindings take ("adamw")
  bool layerwise;    // per-tensor norms scale the update (two passes over a tensor), else element-wise
  // The OptimOptions fields the algorithm reads, by the names the bindings take (every algorithm also reads
  // maximize and skip_zeros).
  const char* options[kMaxOptimOptions];
  OptimStateSpec states[kMaxOptimStates];
  // Per-tensor float64 values the algorithm carries from step to step besides its states (running sums over
  // the steps, kept per parameter like its step count), by their state_dict keys: its rule advances them once
  // per tensor and step, before the update (src/optim/rules.h, advance_schedule). None for most algorithms.
  const char* schedule[kMaxScheduleValues] = {};
};

inline constexpr OptimAlgorithmSpec kOptimAlgorithms[] = {
    {OptimAlgorithm::Adam, "adam", false, {"beta1", "beta2", "eps", "weight_decay", "amsgrad"},
     {{"exp_avg", true}, {"exp_avg_sq", false}, {"max_exp_avg_sq", false, StatePresence::IfAmsgrad}}},
    {OptimAlgorithm::AdamW, "adamw", false, {"beta1", "beta2", "eps", "weight_decay", "amsgrad"},
     {{"exp_avg", true}, {"exp_avg_sq", false}, {"max_exp_avg_sq", false, StatePresence::IfAmsgrad}}},
    {OptimAlgorithm::SGD, "sgd", false, {"momentum", "dampening", "weight_decay", "nesterov"},
     {{"momentum_buffer", true, StatePresence::IfMomentumNonZero}}},
    {OptimAlgorithm::RMSprop, "rmsprop", false, {"alpha", "eps", "weight_decay", "momentum", "centered"},
     {{"square_avg", false},
      {"grad_avg", true, StatePresence::IfCentered},
      {"momentum_buffer", true, StatePresence::IfMomentumPositive}}},
    {OptimAlgorithm::Adagrad, "adagrad", false, {"lr_decay", "eps", "weight_decay"}, {{"sum", false}}},
    {OptimAlgorithm::Lion, "lion", false, {"beta1", "beta2", "weight_decay"}, {{"exp_avg", true}}},
    {OptimAlgorithm::LAMB, "lamb", true, {"beta1", "beta2", "eps", "weight_decay", "bias_correction"},
     {{"exp_avg", true}, {"exp_avg_sq", false}}},
    {OptimAlgorithm::LARS, "lars", true, {"momentum", "weight_decay", "trust_coefficient", "eps"},
     {{"momentum_buffer", true}}},
    {OptimAlgorithm::AdEMAMix, "ademamix", false,
     {"beta1", "beta2", "beta3", "mix_alpha", "alpha_warmup", "beta3_warmup", "eps", "weight_decay"},
     {{"exp_avg", true}, {"exp_avg_slow", true}, {"exp_avg_sq", false}}},
    // z is an iterate of the parameter's scale, moved by lr-sized steps each step: 8-bit codes (a relative
    // error of about 1% of the block's largest value) would round those steps away.
    {OptimAlgorithm::AdamWScheduleFree, "adamw_schedulefree", false,
     {"beta1", "beta2", "eps", "weight_decay", "warmup_steps", "r", "weight_lr_power"},
     {{"z", true, StatePresence::Always, kStorage32 | kStorage16, StateInit::Param}, {"exp_avg_sq", false}},
     {"weight_sum", "lr_max"}},
};

inline constexpr int kOptimAlgorithmCount = static_cast<int>(sizeof(kOptimAlgorithms) / sizeof(kOptimAlgorithms[0]));

constexpr bool table_in_enum_order() {
  for (int i = 0; i < kOptimAlgorithmCount; ++i)
    if (static_cast<int>(kOptimAlgorithms[i].algorithm) != i) return false;
  return true;
}
static_assert(table_in_enum_order(), "kOptimAlgorithms must list the algorithms in OptimAlgorithm's order");

constexpr const OptimAlgorithmSpec& optim_algorithm_spec(OptimAlgorithm a) {
  return kOptimAlgorithms[static_cast<int>(a)];
}

// How many states the algorithm keeps at most and at least (over all options).
constexpr int optim_max_states(OptimAlgorithm a) {
  int n = 0;
  for (const OptimStateSpec& s : optim_algorithm_spec(a).states) n += s.name != nullptr;
  return n;
}
// How many schedule values the algorithm keeps per tensor.
constexpr int optim_schedule_size(OptimAlgorithm a) {
  int n = 0;
  for (const char* name : optim_algorithm_spec(a).schedule) n += name != nullptr;
  return n;
}
constexpr int optim_min_states(OptimAlgorithm a) {
  int n = 0;
  for (const OptimStateSpec& s : optim_algorithm_spec(a).states)
    n += s.name != nullptr && s.presence == StatePresence::Always;
  return n;
}

}  // namespace graphsafe
