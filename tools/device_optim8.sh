#!/usr/bin/env bash
# One GPU-machine call for tuning the 8-bit optimizer kernels: build, the C++ tests (emulated kernels included)
# beside the CUDA optimizer tests, the 8-bit timings (tools/time_optim8.py), and an ncu summary of the 8-bit
# AdamW kernel for fp32 and bf16 parameters. Logs go to $OUT. Needs .deps/googletest (see device_check.sh).
# SKIP_TESTS=1 leaves the tests out; NCU=0 leaves ncu out.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
START=$SECONDS
python3 -m pip install --no-build-isolation --no-deps . > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
echo "built in $((SECONDS-START)) s"
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  (cmake -S . -B build/cpp -G Ninja -DGRAPHSAFE_BUILD_TESTS=ON -DGRAPHSAFE_GTEST_SOURCE_DIR="$PWD/.deps/googletest" \
    && cmake --build build/cpp -j 12 && ctest --test-dir build/cpp --output-on-failure) > "$OUT/ctest.log" 2>&1 &
  CTEST=$!
  timeout 330 python3 -m pytest -q -p no:cacheprovider ${PYTEST_FILES:-tests/python/test_optim_cuda.py} > "$OUT/pytest_cuda.log" 2>&1
  echo "pytest rc=$? at $((SECONDS-START)) s: $(tail -1 "$OUT/pytest_cuda.log")"
  grep -E "^(FAILED|ERROR)|Error|assert" "$OUT/pytest_cuda.log" | head -20
  wait $CTEST
  echo "ctest at $((SECONDS-START)) s: $(grep -E 'tests passed|tests failed' "$OUT/ctest.log")"
  grep -E "Failed|FAILED" "$OUT/ctest.log" | head
fi
python3 tools/time_optim8.py --all-algorithms 2>&1 | tee "$OUT/time_optim8.txt"
echo "timed at $((SECONDS-START)) s"
if [ "${NCU:-1}" != 0 ]; then
  for dtype in float32 bfloat16; do
    ncu --clock-control none --kernel-name regex:elementwise_kernel --launch-skip 2 --launch-count 1 \
      --section SpeedOfLight --section Occupancy --section WarpStateStats --section SchedulerStats \
      --section InstructionStats --section LaunchStats --section MemoryWorkloadAnalysis_Tables \
      python3 tools/profile_optim8.py $dtype 8 > "$OUT/ncu_$dtype.txt" 2>&1
    echo "== ncu $dtype"; grep -E "^\s+(Duration|DRAM Throughput|Issue Slots Busy|Executed Ipc Active|Registers Per Thread|Achieved Occupancy|Executed Instructions |No Eligible|Warp Cycles Per Issued)" "$OUT/ncu_$dtype.txt"
  done
fi
echo "done at $((SECONDS-START)) s"
