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
    for (int states = 0; states <= kMaxOptimStates; ++states) {
      const bool in_range = states >= optim_min_states(spec.algorithm) && states <= optim_max_states(spec.algorithm);
      if (optim_detail::can_keep_states(spec.algorithm, states) != in_range) return false;
    }
  }
  return true;
}
static_assert(rules_agree_with_table(), "rules.h's is_layerwise / can_keep_states disagree with kOptimAlgorithms");

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
// Every option an algorithm of the table may name: the OptimOptions field it sets.
struct OptionField {
  const char* name;
  double OptimOptions::*number;
  bool OptimOptions::*flag;
};
constexpr OptionField kOptionFields[] = {
    {"beta1", &OptimOptions::beta1, nullptr},
    {"beta2", &OptimOptions::beta2, nullptr},
    {"beta3", &OptimOptions::beta3, nullptr},
    {"eps", &OptimOptions::eps, nullptr},
    {"weight_decay", &OptimOptions::weight_decay, nullptr},
    {"momentum", &OptimOptions::momentum, nullptr},
    {"dampening", &OptimOptions::dampening, nullptr},
    {"alpha", &OptimOptions::alpha, nullptr},
    {"lr_decay", &OptimOptions::lr_decay, nullptr},
    {"mix_alpha", &OptimOptions::mix_alpha, nullptr},
    {"alpha_warmup", &OptimOptions::alpha_warmup, nullptr},
    {"beta3_warmup", &OptimOptions::beta3_warmup, nullptr},
    {"trust_coefficient", &OptimOptions::trust_coefficient, nullptr},
    {"amsgrad", nullptr, &OptimOptions::amsgrad},
    {"maximize", nullptr, &OptimOptions::maximize},
    {"nesterov", nullptr, &OptimOptions::nesterov},
    {"centered", nullptr, &OptimOptions::centered},
    {"bias_correction", nullptr, &OptimOptions::bias_correction},
    {"skip_zeros", nullptr, &OptimOptions::skip_zeros},
};

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
      for (const OptionField& field : kOptionFields) found = found || same_name(option, field.name);
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
  for (const OptionField& field : kOptionFields) {
    if (name != field.name) continue;
    if (field.number != nullptr) o.*(field.number) = value;
    else o.*(field.flag) = value != 0.0;
    return;
  }
}

void validate_optim_options(const OptimOptions& o) {
  auto in_unit = [](double b) { return std::isfinite(b) && b >= 0.0 && b < 1.0; };
  require(std::isfinite(o.eps) && o.eps >= 0.0, "eps must be >= 0, got " + value(o.eps));
  require(std::isfinite(o.weight_decay) && o.weight_decay >= 0.0,
          "weight_decay must be >= 0, got " + value(o.weight_decay));
  require(std::isfinite(o.momentum) && o.momentum >= 0.0, "momentum must be >= 0, got " + value(o.momentum));
  switch (o.algorithm) {
    case OptimAlgorithm::Adam:
    case OptimAlgorithm::AdamW:
    case OptimAlgorithm::LAMB:
    case OptimAlgorithm::Lion:
      require(in_unit(o.beta1), "betas[0] must be in [0, 1), got " + value(o.beta1));
      require(in_unit(o.beta2), "betas[1] must be in [0, 1), got " + value(o.beta2));
      break;
    case OptimAlgorithm::AdEMAMix:
      require(in_unit(o.beta1), "betas[0] must be in [0, 1), got " + value(o.beta1));
      require(in_unit(o.beta2), "betas[1] must be in [0, 1), got " + value(o.beta2));
      require(in_unit(o.beta3), "betas[2] must be in [0, 1), got " + value(o.beta3));
      require(std::isfinite(o.mix_alpha) && o.mix_alpha >= 0.0, "alpha must be >= 0, got " + value(o.mix_alpha));
      require(std::isfinite(o.alpha_warmup) && std::isfinite(o.beta3_warmup) && o.alpha_warmup >= 0.0 &&
                  o.beta3_warmup >= 0.0,
              "warm-up lengths must be finite and >= 0");
      require(o.beta3_warmup == 0.0 || (o.beta1 > 0.0 && o.beta3 > 0.0),
              "the beta3 warm-up needs betas[0] > 0 and betas[2] > 0");
      break;
    case OptimAlgorithm::SGD:
      require(!o.nesterov || (o.momentum > 0.0 && o.dampening == 0.0),
              "nesterov momentum requires a momentum and zero dampening");
      require(std::isfinite(o.dampening), "dampening must be finite");
      break;
    case OptimAlgorithm::RMSprop:
      require(std::isfinite(o.alpha) && o.alpha >= 0.0, "alpha must be >= 0, got " + value(o.alpha));
      break;
    case OptimAlgorithm::Adagrad:
      require(std::isfinite(o.lr_decay) && o.lr_decay >= 0.0, "lr_decay must be >= 0, got " + value(o.lr_decay));
      break;
    case OptimAlgorithm::LARS:
      require(std::isfinite(o.trust_coefficient) && o.trust_coefficient > 0.0,
              "trust_coefficient must be > 0, got " + value(o.trust_coefficient));
      break;
  }
}

void optim_detail::check_step_args(const OptimStepArgs& a, const OptimTensor* tensors, int count) {
  validate_optim_options(a.options);
  if (a.param_dtype != DType::Float32 && a.param_dtype != DType::Float16 && a.param_dtype != DType::BFloat16)
    throw std::invalid_argument(std::string("optimizer parameters must be float32, float16 or bfloat16, got ") +
                                dtype_name(a.param_dtype));
  if (a.lr == nullptr) throw std::invalid_argument("optimizer step: lr pointer is null");
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
    for (int j = 0; j < states; ++j) {
      const bool present = a.state_bits != 8 ? x.state[j] != nullptr : x.codes[j] != nullptr && x.absmax[j] != nullptr;
      if (x.numel > 0 && !present)
        throw std::invalid_argument("optimizer step: state " + std::to_string(j) + " of tensor " + std::to_string(t) +
                                    " is null");
    }
  }
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
  if (!optim_detail::is_layerwise(o.algorithm)) return 0;
  return optim_detail::layerwise_layout(numels, count).bytes;
}

}  // namespace graphsafe
