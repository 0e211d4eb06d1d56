// libFuzzer harness: 8-bit blockwise quantisation (quantize_blockwise_cpu / dequantize_blockwise_cpu,
// include/graphsafe/optim.h) against a brute-force nearest-map-value reference.
//
// Fuzzed: block size (32 to 1024, and invalid ones), signed or unsigned map, length (0, 1, block size +-1,
// several blocks plus a tail, up to 4 blocks of 1024), value families over many decades (zeros, subnormals, values
// far apart in one block) and raw fuzzed bits.
// Checked, for every block (a NaN or ±inf value counts as 0: docs/optim.md, "Non-finite values"):
//   * absmax is the largest |value| among the finite values (0 if none), bit for bit;
//   * each code is the nearest map value to value / absmax, the one nearer zero on a tie, found by scanning all
//     256 map values in fp64, with value / absmax formed as src/optim/blockwise.h documents it (times the fp32
//     reciprocal of absmax, both scaled by 2^24 first for a subnormal absmax); and within one code of the nearest
//     map value to the exact quotient;
//   * dequantising gives map[code] * absmax in fp32, bit for bit;
//   * an invalid block size is refused with std::invalid_argument;
//   * the map: 256 strictly increasing values with 0 and 1 (and -1 when signed) exact.
// Buffers are exactly numel codes, ceil(numel / block_size) scales and numel outputs (ASan).
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <vector>

#include "fuzz_common.h"
#include "graphsafe/optim.h"

using namespace graphsafe;

namespace {

// The code of the map value nearest to x (fp64 distances), the one nearer zero on an exact tie.
int nearest_code(const float* map, float x) {
  int best = 0;
  double best_distance = std::fabs(static_cast<double>(map[0]) - x);
  for (int c = 1; c < 256; ++c) {
    const double d = std::fabs(static_cast<double>(map[c]) - x);
    if (d < best_distance || (d == best_distance && std::fabs(map[c]) < std::fabs(map[best]))) {
      best = c;
      best_distance = d;
    }
  }
  return best;
}

void check_map(const float* map, bool is_signed) {
  for (int c = 1; c < 256; ++c) FUZZ_CHECK(map[c - 1] < map[c], "map not increasing at %d\n", c);
  FUZZ_CHECK(map[255] == 1.0f, "largest map value %g\n", map[255]);
  FUZZ_CHECK(is_signed ? map[0] == -1.0f : map[0] == 0.0f, "smallest map value %g\n", map[0]);
  bool has_zero = false;
  for (int c = 0; c < 256; ++c) has_zero |= fuzz::bits_of(map[c]) == 0u;
  FUZZ_CHECK(has_zero, "no +0 in the map\n");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* bytes, size_t size) {
  FuzzedDataProvider data(bytes, size);
  const bool is_signed = data.ConsumeBool();
  const int size_pick = data.ConsumeIntegralInRange<int>(0, 15);
  int block_size = 32 << (size_pick % 6);
  if (size_pick == 15) block_size = data.ConsumeIntegralInRange<int>(-1, 2048);  // mostly invalid
  const int length_kind = data.ConsumeIntegralInRange<int>(0, 7);
  const int64_t b = block_size > 0 ? block_size : 32;
  int64_t numel = 0;
  switch (length_kind) {
    case 0: numel = 0; break;
    case 1: numel = 1; break;
    case 2: numel = b - 1; break;
    case 3: numel = b; break;
    case 4: numel = b + 1; break;
    default: numel = data.ConsumeIntegralInRange<int64_t>(0, 4 * 1024 + 3); break;
  }
  const int family = data.ConsumeIntegral<uint8_t>();
  const float scale = std::ldexp(1.0f, data.ConsumeIntegralInRange<int>(-140, 120));
  fuzz::Rng rng(data.ConsumeIntegral<uint64_t>());
  std::vector<float> x(static_cast<std::size_t>(numel));
  for (auto& v : x) v = fuzz::make_value(rng, family, scale);
  // Some blocks spread over many decades: a large value among tiny ones.
  if (numel > 0 && data.ConsumeBool()) x[rng.below(static_cast<uint32_t>(numel))] = scale * 1e6f;
  for (std::size_t i = 0; i < x.size() && data.remaining_bytes() >= 4; ++i) {
    const uint32_t raw = data.ConsumeIntegral<uint32_t>();
    std::memcpy(&x[i], &raw, 4);
  }

  const float* map = quantization_map(is_signed);
  check_map(map, is_signed);
  const bool valid = block_size >= 32 && block_size <= 1024 && (block_size & (block_size - 1)) == 0;
  const int64_t blocks = valid ? (numel + block_size - 1) / block_size : 1;
  std::vector<uint8_t> codes(static_cast<std::size_t>(numel));
  std::vector<float> absmax(static_cast<std::size_t>(blocks)), out(static_cast<std::size_t>(numel));
  if (!valid) {
    bool refused = false;
    try {
      quantize_blockwise_cpu(x.data(), numel, block_size, is_signed, codes.data(), absmax.data());
    } catch (const std::invalid_argument&) {
      refused = true;
    }
    FUZZ_CHECK(refused, "block size %d accepted by quantize_blockwise_cpu\n", block_size);
    refused = false;
    try {
      dequantize_blockwise_cpu(codes.data(), absmax.data(), numel, block_size, is_signed, out.data());
    } catch (const std::invalid_argument&) {
      refused = true;
    }
    FUZZ_CHECK(refused, "block size %d accepted by dequantize_blockwise_cpu\n", block_size);
    return 0;
  }
  quantize_blockwise_cpu(x.data(), numel, block_size, is_signed, codes.data(), absmax.data());
  dequantize_blockwise_cpu(codes.data(), absmax.data(), numel, block_size, is_signed, out.data());

  for (int64_t blk = 0; blk < blocks; ++blk) {
    const int64_t begin = blk * block_size, end = std::min(numel, begin + block_size);
    float largest = 0.0f;
    for (int64_t i = begin; i < end; ++i)
      if (std::isfinite(x[i])) largest = std::fmax(largest, std::fabs(x[i]));
    FUZZ_CHECK(fuzz::bits_of(absmax[blk]) == fuzz::bits_of(largest), "block %lld: absmax %a, largest |x| %a\n",
               (long long)blk, absmax[blk], largest);
    // value / absmax as blockwise.h forms it: value * (1 / absmax), both scaled by 2^24 for a subnormal absmax.
    const float prescale = largest < 1.17549435e-38f ? 16777216.0f : 1.0f;
    const float inverse = largest > 0.0f ? 1.0f / (largest * prescale) : 0.0f;
    for (int64_t i = begin; i < end; ++i) {
      const float value = std::isfinite(x[i]) ? x[i] : 0.0f;  // stored as a 0 would be
      const float normalized = (value * prescale) * inverse;
      const int want = nearest_code(map, normalized);
      FUZZ_CHECK(codes[i] == want, "element %lld = %a in block %lld (absmax %a): code %d, nearest %d (x/absmax %a)\n",
                 (long long)i, x[i], (long long)blk, largest, codes[i], want, normalized);
      if (largest > 0.0f) {
        const int exact = nearest_code(map, static_cast<float>(static_cast<double>(value) / largest));
        FUZZ_CHECK(std::abs(exact - want) <= 1, "element %lld: code %d, exact quotient's %d\n", (long long)i, want,
                   exact);
      }
      const float decoded = map[codes[i]] * absmax[blk];
      FUZZ_CHECK(fuzz::bits_of(out[i]) == fuzz::bits_of(decoded), "element %lld: dequantised %a, map * absmax %a\n",
                 (long long)i, out[i], decoded);
    }
  }
  return 0;
}
