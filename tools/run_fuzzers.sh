#!/usr/bin/env bash
# Builds the libFuzzer harnesses of tests/fuzz (clang, ASan+UBSan, CPU backend) and runs each one for SECONDS
# seconds, starting from its committed corpus tests/fuzz/corpus/<harness>/ (every committed input, the ones that
# once found a bug included, runs first, so they are regression inputs too). Any crash, sanitizer report,
# failed property, leak or timeout fails the run; the input is written to BUILD_DIR/artifacts/.
#
#   tools/run_fuzzers.sh [SECONDS] [HARNESS...]     SECONDS defaults to 60 (CI's bounded run)
#
# Environment: BUILD_DIR (default build/fuzz), FORK (libFuzzer -fork=N: N processes, for long runs),
# MERGE=1 (afterwards, add to the committed corpus the fewest of the run's finds that keep their coverage: review and
# commit them).
# New inputs a run finds go to BUILD_DIR/corpus/<harness>/, never into the source tree unless MERGE=1.
set -euo pipefail
cd "$(dirname "$0")/.."

SECONDS_EACH=${1:-60}
shift || true
HARNESSES=("$@")
[ ${#HARNESSES[@]} -gt 0 ] || HARNESSES=(fuzz_embedding_backward fuzz_quantize_blockwise fuzz_optim_step)
BUILD_DIR=${BUILD_DIR:-build/fuzz}
GENERATOR=$(command -v ninja >/dev/null 2>&1 && echo "-G Ninja" || true)

# shellcheck disable=SC2086
cmake -S . -B "$BUILD_DIR" $GENERATOR -DCMAKE_CXX_COMPILER=clang++ -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DGRAPHSAFE_CUDA=OFF -DGRAPHSAFE_BUILD_FUZZERS=ON -DGRAPHSAFE_INSTALL_CPP=OFF >/dev/null
cmake --build "$BUILD_DIR" --target "${HARNESSES[@]}" -j "${JOBS:-2}"

# Every report ends the run with a stack trace (libFuzzer then saves the input).
export ASAN_OPTIONS=${ASAN_OPTIONS:-halt_on_error=1:abort_on_error=1:print_stacktrace=1:detect_leaks=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-halt_on_error=1:abort_on_error=1:print_stacktrace=1}

mkdir -p "$BUILD_DIR/artifacts"
summary=()
for harness in "${HARNESSES[@]}"; do
  seeds=tests/fuzz/corpus/${harness#fuzz_}
  found="$BUILD_DIR/corpus/${harness#fuzz_}"
  mkdir -p "$found" "$seeds"
  log="$BUILD_DIR/$harness.log"
  fork_args=()
  [ -n "${FORK:-}" ] && fork_args=(-fork="$FORK" -ignore_crashes=0)
  echo "== $harness: ${SECONDS_EACH} s from $(find "$seeds" -type f | wc -l) committed inputs"
  start=$SECONDS
  if ! "$BUILD_DIR/tests/fuzz/$harness" -max_total_time="$SECONDS_EACH" -timeout=30 -rss_limit_mb=4096 \
      -print_final_stats=1 -artifact_prefix="$BUILD_DIR/artifacts/$harness-" "${fork_args[@]}" \
      "$found" "$seeds" >"$log" 2>&1; then
    tail -60 "$log"
    echo "FAILED: $harness (the input is in $BUILD_DIR/artifacts/; reproduce with $BUILD_DIR/tests/fuzz/$harness <input>)"
    exit 1
  fi
  runs=$(grep -o 'stat::number_of_executed_units: [0-9]*' "$log" | tail -1 | grep -o '[0-9]*$' || true)
  [ -n "$runs" ] || runs=$(grep -oE '^Done [0-9]+ runs' "$log" | tail -1 | grep -oE '[0-9]+' || echo '?')
  cov=$(grep -oE 'cov: [0-9]+ ft: [0-9]+' "$log" | tail -1 || true)
  summary+=("$harness: $runs executions in $((SECONDS - start)) s, ${cov:-?}, $(find "$found" -type f | wc -l) new inputs")
  if [ "${MERGE:-0}" = 1 ]; then
    "$BUILD_DIR/tests/fuzz/$harness" -set_cover_merge=1 "$seeds" "$found" >>"$log" 2>&1
  fi
done
printf '%s\n' "${summary[@]}"
