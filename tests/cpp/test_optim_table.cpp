// The algorithm table (graphsafe/optim_algorithms.h) against the rest of the core: names round-trip, the 8-bit
// kernels' choice of map and the dispatch agree with it for every option combination, options belong to their
// algorithm.
#include <gtest/gtest.h>

#include <stdexcept>
#include <vector>

#include "graphsafe/optim.h"
#include "optim/blockwise.h"
#include "optim/rules.h"

using namespace graphsafe;

namespace {
// Every combination of the options that decide which states exist.
std::vector<OptimOptions> presence_variants(OptimAlgorithm a) {
  std::vector<OptimOptions> variants;
  for (int amsgrad = 0; amsgrad < 2; ++amsgrad)
    for (int centered = 0; centered < 2; ++centered)
      for (double momentum : {0.0, 0.9}) {
        OptimOptions o;
        o.algorithm = a;
        o.amsgrad = amsgrad;
        o.centered = centered;
        o.momentum = momentum;
        variants.push_back(o);
      }
  return variants;
}
}  // namespace

TEST(OptimTable, NamesRoundTripAndAreUnique) {
  for (const OptimAlgorithmSpec& spec : kOptimAlgorithms) {
    EXPECT_EQ(optim_algorithm_from_name(spec.name), spec.algorithm) << spec.name;
    for (const OptimAlgorithmSpec& other : kOptimAlgorithms)
      if (&other != &spec) EXPECT_STRNE(spec.name, other.name);
  }
  EXPECT_THROW(optim_algorithm_from_name("adamax"), std::invalid_argument);
}

TEST(OptimTable, KernelSignednessAndDispatchAgreeWithTheTable) {
  for (const OptimAlgorithmSpec& spec : kOptimAlgorithms) {
    for (const OptimOptions& o : presence_variants(spec.algorithm)) {
      const int count = optim_state_count(o);
      EXPECT_GE(count, optim_min_states(spec.algorithm));
      EXPECT_LE(count, optim_max_states(spec.algorithm));
      for (int j = 0; j < count; ++j)  // the 8-bit kernels' choice of map (blockwise.h) is the table's
        EXPECT_EQ(optim_detail::state_is_signed(o, j), optim_state_spec(o, j).is_signed)
            << spec.name << " state " << optim_state_spec(o, j).name;
      EXPECT_THROW(optim_state_spec(o, count), std::invalid_argument);
    }
    OptimAlgorithm dispatched = spec.algorithm == OptimAlgorithm::Adam ? OptimAlgorithm::AdamW : OptimAlgorithm::Adam;
    optim_detail::with_algorithm(spec.algorithm, [&](auto tag) { dispatched = decltype(tag)::value; });
    EXPECT_EQ(dispatched, spec.algorithm) << spec.name;
  }
}

TEST(OptimTable, OptionsAreTheAlgorithmsOwn) {
  OptimOptions o;
  o.algorithm = OptimAlgorithm::SGD;
  set_optim_option(o, "momentum", 0.5);
  set_optim_option(o, "nesterov", 1.0);
  set_optim_option(o, "skip_zeros", 1.0);
  EXPECT_EQ(o.momentum, 0.5);
  EXPECT_TRUE(o.nesterov);
  EXPECT_TRUE(o.skip_zeros);
  EXPECT_THROW(set_optim_option(o, "beta1", 0.9), std::invalid_argument);  // not an SGD option
  EXPECT_THROW(set_optim_option(o, "no_such_option", 1.0), std::invalid_argument);
}
