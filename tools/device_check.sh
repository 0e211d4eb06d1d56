#!/usr/bin/env bash
# One call on the GPU machine: build, C++ tests, CUDA pytest files, benchmarks. Logs go to $OUT.
# The GPU image has no GoogleTest: before the call, here, `mkdir -p .deps && cp -r /usr/src/googletest .deps/`
# and `echo /.deps/ >> .git/info/exclude`; then run (device tool) `bash tools/device_check.sh <commit>` with
# carry [".deps"]. PYTEST_FILES, TRAIN_ARGS, SANITIZE, BENCH, BENCH_ARGS and BENCH_TIMEOUT narrow or widen what runs; NCU=1 adds an
# ncu summary of the 8-bit AdamW kernel (fp32 and bf16 parameters, tools/profile_optim8.py) before the benchmark.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export GRAPHSAFE_COMMIT=${1:-unknown} PYTHONUNBUFFERED=1
START=$SECONDS
# pytest-timeout may be missing on the GPU image; use it only when present.
TIMEOUT_ARG=$(python3 -c "import pytest_timeout" 2>/dev/null && echo "--timeout 120")
python3 -m pip install --no-build-isolation --no-deps . > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
echo "built in $((SECONDS-START)) s"
# The C++ tests (their build is CPU work) and the CUDA pytest files run side by side; the benchmark after both.
(cmake -S . -B build/cpp -G Ninja -DGRAPHSAFE_BUILD_TESTS=ON -DGRAPHSAFE_GTEST_SOURCE_DIR="$PWD/.deps/googletest" \
  && cmake --build build/cpp -j 16 && ctest --test-dir build/cpp --output-on-failure) > "$OUT/ctest.log" 2>&1 &
CTEST=$!
timeout ${PYTEST_TIMEOUT:-330} python3 -m pytest -q -p no:cacheprovider $TIMEOUT_ARG ${PYTEST_FILES:-tests/python/test_embedding_cuda.py tests/python/test_embedding_lookup.py tests/python/test_optim_cuda_vs_cpu.py tests/python/test_optim_cuda_8bit.py tests/python/test_optim_cuda_capture.py tests/python/test_optim_cuda_skip_zeros.py tests/python/test_optim_cuda_devices.py tests/python/test_optim_schedule_free.py tests/python/test_distributed_cuda.py tests/python/test_graph_data_parallel_cuda.py} > "$OUT/pytest_cuda.log" 2>&1
echo "pytest rc=$? at $((SECONDS-START)) s: $(tail -1 "$OUT/pytest_cuda.log")"
grep -E "^(FAILED|ERROR)" "$OUT/pytest_cuda.log" | head -20
wait $CTEST
echo "ctest at $((SECONDS-START)) s: $(grep -E 'tests passed|tests failed' "$OUT/ctest.log")"
# SANITIZE=1: compute-sanitizer's memcheck and racecheck over every CUDA kernel family (tools/sanitizer_cases.py,
# small shapes: racecheck checks every shared-memory access) and memcheck over the C++ CUDA tests. memcheck runs
# without torch's caching allocator, so that each tensor is its own allocation and an access past its end is
# seen. Reports and summaries go to $OUT/sanitizer_*.txt.
if [ "${SANITIZE:-0}" = 1 ]; then
  for tool in memcheck racecheck; do
    PYTORCH_NO_CUDA_MEMORY_CACHING=$([ $tool = memcheck ] && echo 1 || echo 0) timeout ${SANITIZE_TIMEOUT:-240} \
      compute-sanitizer --tool $tool --error-exitcode 9 --print-limit 50 python3 tools/sanitizer_cases.py \
      > "$OUT/sanitizer_$tool.txt" 2>&1
    echo "compute-sanitizer $tool (tools/sanitizer_cases.py): rc=$? at $((SECONDS-START)) s;" \
      "$(grep -hE 'ERROR SUMMARY|RACECHECK SUMMARY|sanitizer cases' "$OUT/sanitizer_$tool.txt" | tr '\n' ' ')"
  done
  timeout 120 compute-sanitizer --tool memcheck --error-exitcode 9 --print-limit 50 build/cpp/tests/cpp/graphsafe_tests \
    --gtest_brief=1 > "$OUT/sanitizer_memcheck_cpp.txt" 2>&1
  echo "compute-sanitizer memcheck (C++ tests): rc=$? at $((SECONDS-START)) s;" \
    "$(grep -hE 'ERROR SUMMARY|PASSED|FAILED' "$OUT/sanitizer_memcheck_cpp.txt" | tr '\n' ' ')"
fi
# TRAIN_ARGS: also run `graphsafe train` with these arguments (its summary goes to $OUT/train.txt).
if [ -n "${TRAIN_ARGS:-}" ]; then
  timeout 200 graphsafe train $TRAIN_ARGS > "$OUT/train.txt" 2>&1
  echo "train rc=$? at $((SECONDS-START)) s"; grep -E "^\| (mode|step time|loss|determinism|optimizer)" "$OUT/train.txt"
fi
if [ "${NCU:-0}" = 1 ]; then
  for dtype in float32 bfloat16; do
    ncu --clock-control none --kernel-name regex:quantized_elementwise_kernel --launch-skip 2 --launch-count 1 \
      --section SpeedOfLight --section Occupancy --section WarpStateStats --section SchedulerStats \
      --section InstructionStats --section LaunchStats --section MemoryWorkloadAnalysis_Tables \
      python3 tools/profile_optim8.py $dtype 8 > "$OUT/ncu_$dtype.txt" 2>&1
    echo "== ncu 8-bit AdamW $dtype"
    grep -E "^\s+(Duration|DRAM Throughput|Issue Slots Busy|Registers Per Thread|Achieved Occupancy|Executed Instructions |No Eligible)" "$OUT/ncu_$dtype.txt"
  done
fi
# BENCH=0: no benchmark. The device tool stops a call at 600 s; the benchmark gets what is left (minus a
# margin), unless told.
[ "${BENCH:-1}" = 0 ] && exit 0
BENCH_TIMEOUT=${BENCH_TIMEOUT:-$((570-(SECONDS-START)))}
timeout $BENCH_TIMEOUT python3 -m graphsafe bench ${BENCH_ARGS:-} --json-out "$OUT/bench.jsonl" > "$OUT/bench.txt" 2> "$OUT/bench.err"
echo "bench rc=$?"
grep -v '^{' "$OUT/bench.txt" | grep -E '^\||^#' | head -80
