// Optimizer options and the algorithm table's queries (graphsafe/optim_algorithms.h): names, option fields,
// state specs, validation, workspace sizes; shared by both backends and the bindings.
#include <cmath>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <string_view>

#include "graphsafe/optim.h"
#include "optim/blockwise.h"
#include "optim/layout.h"
#include "optim/rules.h"
#include "optim/sparse.h"

namespace graphsafe {

namespace {
void require(bool ok, const std::string& what) {
  if (!ok) throw std::invalid_argument("invalid optimizer hyperparameter: " + what);
}
std::string value(double v) { return std::to_string(v); }
}  // namespace

// The rules' compile-time view of each algorithm (src/optim/rules.h, device code) agrees with the table.
constexpr bool rules_agree_with_table() {
  for (const OptimAlgorithmSpec& spec : kOptimAlgorithms) {
    if (optim_detail::is_layerwise(spec.algorithm) != spec.layerwise) return false;
    if (optim_detail::schedule_size(spec.algorithm) != optim_schedule_size(spec.algorithm)) return false;
    bool all_8bit = true;
    for (const OptimStateSpec& state : spec.states) all_8bit = all_8bit && (state.storage & kStorage8) != 0;
    if (optim_detail::quantizable(spec.algorithm) != all_8bit) return false;
    for (int states = 0; states <= kMaxOptimStates; ++states) {
      const bool in_range = states >= optim_min_states(spec.algorithm) && states <= optim_max_states(spec.algorithm);
      if (optim_detail::can_keep_states(spec.algorithm, states) != in_range) return false;
    }
  }
  return true;
}
static_assert(rules_agree_with_table(),
              "rules.h's is_layerwise / schedule_size / quantizable / can_keep_states disagree with kOptimAlgorithms");

const OptimStateSpec& optim_state_spec(const OptimOptions& o, int j) {
  int present = 0;
  for (const OptimStateSpec& s : optim_algorithm_spec(o.algorithm).states)
    if (s.name != nullptr && optim_state_present(o, s.presence) && present++ == j) return s;
  throw std::invalid_argument("optimizer state " + std::to_string(j) + " out of range: " +
                              optim_algorithm_spec(o.algorithm).name + " keeps " +
                              std::to_string(optim_state_count(o)) + " states with these options");
}

OptimAlgorithm optim_algorithm_from_name(std::string_view name) {
  for (const OptimAlgorithmSpec& spec : kOptimAlgorithms)
    if (name == spec.name) return spec.algorithm;
  throw std::invalid_argument("unknown optimizer algorithm '" + std::string(name) + "'");
}

namespace {
constexpr bool same_name(const char* a, const char* b) {
  while (*a != 0 && *a == *b) ++a, ++b;
  return *a == *b;
}

// Every option the table names has a field.
constexpr bool table_options_have_fields() {
  for (const OptimAlgorithmSpec& spec : kOptimAlgorithms)
    for (const char* option : spec.options) {
      if (option == nullptr) continue;
      bool found = false;
      for (const OptimOptionField& field : kOptimOptionFields) found = found || same_name(option, field.name);
      if (!found) return false;
    }
  return true;
}
static_assert(table_options_have_fields(), "an option in kOptimAlgorithms has no OptimOptions field");
}  // namespace

void set_optim_option(OptimOptions& o, std::string_view name, double value) {
  const OptimAlgorithmSpec& spec = optim_algorithm_spec(o.algorithm);
  bool taken = name == "maximize" || name == "skip_zeros";
  for (const char* option : spec.options) taken = taken || (option != nullptr && name == option);
  if (!taken)
    throw std::invalid_argument("unknown optimizer option '" + std::string(name) + "' for " + spec.name);
  for (const OptimOptionField& field : kOptimOptionFields) {
    if (name != field.name) continue;
    if (field.number != nullptr) o.*(field.number) = value;
    else if (field.single != nullptr)  // (a finite value past fp32's range becomes inf, which the checks refuse)
      o.*(field.single) = static_cast<float>(std::isfinite(value) && std::fabs(value) > 3.4028234663852886e38
                                                 ? std::copysign(HUGE_VAL, value) : value);
    else o.*(field.flag) = value != 0.0;
    return;
  }
}

namespace {
// A numeric option's value (a double field, or an fp32 one widened).
double option_number(const OptimOptions& o, const OptimOptionField& field) {
  return field.number != nullptr ? o.*(field.number) : static_cast<double>(o.*(field.single));
}

// The first of o's options (by the table's order) outside its range (kOptimOptionFields), or null.
const char* out_of_range(const OptimOptions& o, const OptimOptionField& field) {
  if (field.number == nullptr && field.single == nullptr) return nullptr;
  const double v = option_number(o, field);
  switch (field.range) {
    case OptionRange::Flag: return nullptr;
    case OptionRange::Finite: return std::isfinite(v) ? nullptr : "must be finite";
    case OptionRange::NonNegative: return std::isfinite(v) && v >= 0.0 ? nullptr : "must be >= 0";
    case OptionRange::Positive: return std::isfinite(v) && v > 0.0 ? nullptr : "must be > 0";
    case OptionRange::UnitInterval: return std::isfinite(v) && v >= 0.0 && v < 1.0 ? nullptr : "must be in [0, 1)";
  }
  return nullptr;
}
}  // namespace

void validate_optim_options(const OptimOptions& o) {
  for (const char* option : optim_algorithm_spec(o.algorithm).options) {
    if (option == nullptr) continue;
    for (const OptimOptionField& field : kOptimOptionFields) {
      if (!same_name(option, field.name)) continue;
      if (const char* why = out_of_range(o, field))
        require(false, std::string(field.shown_as) + " " + why + ", got " + value(option_number(o, field)));
    }
  }
  // Rules between options, beyond each option's range.
  switch (o.algorithm) {
    case OptimAlgorithm::SGD:
      require(!o.nesterov || (o.momentum > 0.0 && o.dampening == 0.0),
              "nesterov momentum requires a momentum and zero dampening");
      break;
    case OptimAlgorithm::AdEMAMix:
      require(o.beta3_warmup == 0.0 || (o.beta1 > 0.0 && o.beta3 > 0.0),
              "the beta3 warm-up needs betas[0] > 0 and betas[2] > 0");
      break;
    default: break;
  }
}

void optim_detail::check_step_args(const OptimStepArgs& a, const OptimTensor* tensors, int count) {
  validate_optim_options(a.options);
  if (a.param_dtype != DType::Float32 && a.param_dtype != DType::Float16 && a.param_dtype != DType::BFloat16)
    throw std::invalid_argument(std::string("optimizer parameters must be float32, float16 or bfloat16, got ") +
                                dtype_name(a.param_dtype));
  if (a.lr == nullptr) throw std::invalid_argument("optimizer step: lr pointer is null");
  if (a.layerwise_norms != nullptr && !is_layerwise(a.options.algorithm))
    throw std::invalid_argument(std::string("optimizer step: layerwise_norms given for ") +
                                optim_algorithm_spec(a.options.algorithm).name +
                                ", which is not a layer-wise algorithm (LAMB, LARS)");
  if (a.state_bits != 32 && a.state_bits != 16 && a.state_bits != 8)
    throw std::invalid_argument("optimizer step: state_bits must be 32, 16 or 8, got " + std::to_string(a.state_bits));
  if (a.state_bits == 8 && !valid_block_size(a.block_size))
    throw std::invalid_argument("optimizer step: block_size must be a power of two from 32 to 1024, got " +
                                std::to_string(a.block_size));
  const int states = optim_state_count(a.options);
  const uint8_t storage = a.state_bits == 32 ? kStorage32 : a.state_bits == 16 ? kStorage16 : kStorage8;
  for (int j = 0; j < states; ++j) {
    const OptimStateSpec& spec = optim_state_spec(a.options, j);
    if ((spec.storage & storage) == 0)
      throw std::invalid_argument(std::string("optimizer step: ") + optim_algorithm_spec(a.options.algorithm).name +
                                  "'s state " + spec.name + " cannot be stored in " + std::to_string(a.state_bits) +
                                  " bits");
  }
  for (int t = 0; t < count; ++t) {
    const OptimTensor& x = tensors[t];
    if (x.numel < 0) throw std::invalid_argument("optimizer step: negative numel");
    if (x.step == nullptr) throw std::invalid_argument("optimizer step: step pointer is null");
    if (x.numel > 0 && (x.param == nullptr || x.grad == nullptr))
      throw std::invalid_argument("optimizer step: null param or grad pointer");
    for (int j = 0; j < optim_schedule_size(a.options.algorithm); ++j)
      if (x.schedule[j] == nullptr)
        throw std::invalid_argument(std::string("optimizer step: schedule value ") +
                                    optim_algorithm_spec(a.options.algorithm).schedule[j] + " of tensor " +
                                    std::to_string(t) + " is null");
    for (int j = 0; j < states; ++j) {
      const bool present = a.state_bits != 8 ? x.state[j] != nullptr : x.codes[j] != nullptr && x.absmax[j] != nullptr;
      if (x.numel > 0 && !present)
        throw std::invalid_argument("optimizer step: state " + std::to_string(j) + " of tensor " + std::to_string(t) +
                                    " is null");
    }
  }
}

void optim_detail::check_layerwise_norms_args(const OptimStepArgs& a, const OptimTensor* tensors, int count,
                                              const float* norms) {
  if (!is_layerwise(a.options.algorithm))
    throw std::invalid_argument(std::string("optim_layerwise_norms: ") +
                                optim_algorithm_spec(a.options.algorithm).name +
                                " is not a layer-wise algorithm (LAMB, LARS)");
  check_step_args(a, tensors, count);
  if (count > 0 && norms == nullptr) throw std::invalid_argument("optim_layerwise_norms: norms pointer is null");
}

void optim_check_learning_rate_cpu(const float* lr) {
  if (lr == nullptr) throw std::invalid_argument("optimizer step: lr pointer is null");
  optim_detail::check_learning_rate(*lr);
}

void optim_detail::check_learning_rate(float lr) {
  if (usable_learning_rate(lr)) return;
  char text[32];
  std::snprintf(text, sizeof(text), "%g", static_cast<double>(lr));
  throw std::invalid_argument(std::string("invalid learning rate ") + text +
                              " in the optimizer's lr tensor (it must be >= 0): the step changed nothing");
}

const float* quantization_map(bool is_signed) {
  return is_signed ? optim_detail::kSignedMap.value : optim_detail::kUnsignedMap.value;
}

bool optim_state_is_signed(const OptimOptions& options, int j) { return optim_state_spec(options, j).is_signed; }

std::size_t optim_workspace_bytes(Backend, const OptimOptions& o, const int64_t* numels, int count) {
  if (optim_detail::is_layerwise(o.algorithm)) return optim_detail::layerwise_layout(numels, count).bytes;
  if (optim_schedule_size(o.algorithm) > 0) return static_cast<std::size_t>(count) * sizeof(double);
  return 0;
}

std::size_t optim_sparse_workspace_bytes(Backend backend, const OptimOptions& options, DType param_dtype,
                                         int64_t numel) {
  return optim_detail::sparse_workspace_layout(backend, options, param_dtype, numel).bytes;
}

void optim_detail::check_sparse_step_args(Backend backend, const OptimStepArgs& a, const OptimTensor& t,
                                          const OptimSparseGradient& g, const void* workspace,
                                          std::size_t workspace_bytes) {
  OptimTensor with_grad = t;
  with_grad.grad = g.row_grads != nullptr ? g.row_grads : t.param;  // (the dense check wants a gradient pointer)
  check_step_args(a, &with_grad, 1);
  if (!a.options.skip_zeros)
    throw std::invalid_argument("sparse optimizer step: skip_zeros must be on (without it every element of the "
                                "tensor changes, so a step over the rows alone cannot equal the dense step)");
  if (!a.increment_steps) throw std::invalid_argument("sparse optimizer step: increment_steps must be on");
  if (a.layerwise_norms != nullptr)
    throw std::invalid_argument("sparse optimizer step: layerwise_norms (sharded LAMB/LARS) is not supported");
  if (g.row_length <= 0)
    throw std::invalid_argument("sparse optimizer step: row_length must be > 0, got " + std::to_string(g.row_length));
  if (g.row_length > INT32_MAX)  // (the CUDA kernels find an element's column with 32-bit arithmetic)
    throw std::invalid_argument("sparse optimizer step: rows of more than 2^31 - 1 elements are not supported, got " +
                                std::to_string(g.row_length));
  if (t.numel % g.row_length != 0)
    throw std::invalid_argument("sparse optimizer step: row_length " + std::to_string(g.row_length) +
                                " does not divide the tensor's " + std::to_string(t.numel) + " elements");
  if (g.capacity < 0) throw std::invalid_argument("sparse optimizer step: negative capacity");
  if (g.count == nullptr) throw std::invalid_argument("sparse optimizer step: count pointer is null");
  if (g.capacity > 0 && (g.rows == nullptr || g.row_grads == nullptr))
    throw std::invalid_argument("sparse optimizer step: null rows or row_grads pointer");
  const std::size_t needed = sparse_workspace_layout(backend, a.options, a.param_dtype, t.numel).bytes;
  if (workspace_bytes < needed || (needed > 0 && workspace == nullptr))
    throw std::invalid_argument("sparse optimizer step: workspace of " + std::to_string(workspace_bytes) +
                                " bytes is smaller than the " + std::to_string(needed) + " required");
}

}  // namespace graphsafe
