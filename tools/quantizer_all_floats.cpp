// Compares the constant-time quantiser (quantize_value) with its definition (reference_code, a binary
// search) on all 2^32 floats, for both maps. Too slow for CI (about 1.5 minutes on two cores); run it after
// changing src/optim/blockwise.h:
//   g++ -O2 -std=c++17 -fopenmp -Isrc -Iinclude tools/quantizer_all_floats.cpp -o /tmp/quantizer_all_floats
//   /tmp/quantizer_all_floats   # prints the mismatches (none) and exits 0 when there are none
#include <cstdio>

#include "optim/blockwise.h"

using namespace graphsafe;
using namespace graphsafe::optim_detail;

int main() {
  long long mismatches = 0;
  for (bool is_signed : {false, true}) {
    const QuantizationMap& map = host_quantization_map(is_signed);
#pragma omp parallel for reduction(+ : mismatches) schedule(static, 1 << 20)
    for (long long i = 0; i < (1ll << 32); ++i) {
      const float x = bits_float(static_cast<uint32_t>(i));
      if (quantize_value(map, is_signed, x) != reference_code(map.value, is_signed, x)) ++mismatches;
    }
  }
  std::printf("mismatches over all 2^32 floats, both maps: %lld\n", mismatches);
  return mismatches == 0 ? 0 : 1;
}
