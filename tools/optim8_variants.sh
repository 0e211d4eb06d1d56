#!/usr/bin/env bash
# Tuning the 8-bit kernels on the GPU machine, in one call: builds the Python module once per variant, side by
# side, then times the 8-bit rows of the optim bench (tools/time_optim8.py) for each variant in turn, ROUNDS
# times alternating. A variant is a name and CUDA compile definitions that an experiment in the kernels reads
# (say a macro choosing between two versions of a loop; the code on main has none). Logs go to $OUT.
#   bash tools/optim8_variants.sh "base:" "wide:-DEXPERIMENT_WIDE_LOOP=1" ...
# (The seventh session's comparison in docs/benchmarks-history.md was made this way.)
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
ROUNDS=${ROUNDS:-2}
START=$SECONDS
names=()
for spec in "$@"; do
  name=${spec%%:*}; defs=${spec#*:}; names+=("$name")
  (cmake -S . -B "build/var_$name" -G Ninja -DGRAPHSAFE_BUILD_PYTHON=ON -DGRAPHSAFE_INSTALL_CPP=OFF \
     -DCMAKE_BUILD_TYPE=Release -DPython_EXECUTABLE="$(command -v python3)" "-DCMAKE_CUDA_FLAGS=$defs" \
   && cmake --build "build/var_$name" --target _C -j 4 \
   && rm -rf "/tmp/var_$name" && mkdir -p "/tmp/var_$name" && cp -r python/graphsafe "/tmp/var_$name/" \
   && cp build/var_"$name"/_C*.so "/tmp/var_$name/graphsafe/") > "$OUT/build_$name.log" 2>&1 &
done
wait
echo "built in $((SECONDS-START)) s"
for name in "${names[@]}"; do
  ls /tmp/var_"$name"/graphsafe/_C*.so > /dev/null 2>&1 || { echo "$name: build failed"; tail -20 "$OUT/build_$name.log"; }
done
for round in $(seq "$ROUNDS"); do
  for name in "${names[@]}"; do
    echo "== $name (round $round)"
    PYTHONPATH="/tmp/var_$name" python3 tools/time_optim8.py ${TIME_ARGS:-} 2>&1 | tail -12
  done
done
echo "done at $((SECONDS-START)) s"
