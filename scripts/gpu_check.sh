#!/usr/bin/env bash
# One call on a GPU machine: build in place, run the GPU tests, time decode on the 3B and 8B
# presets, write OUTDIR/summary.json and print a short table last.
#   bash scripts/gpu_check.sh OUTDIR
# Environment: PRESETS (default llama-3.2-3b,llama-3.1-8b), PYTEST_MARK (default gpu),
# PYTEST_ARGS (extra pytest options, shell-quoted: PYTEST_ARGS='tests/x.py -k "a or b"'), PYTEST_WORKERS
# (pytest-xdist workers, default 8), PYTEST_SHARD=K/N (the K-th of N interleaved shares of the selected
# tests: the whole GPU suite, 2135 tests, takes ~730 s on 14 workers of an H100 machine (2026-11-27), so
# one call builds (~200 s) and runs 1/3 (~220-270 s), the next calls on the still-warm machine 2/3 and 3/3),
# SKIP_TESTS=1, SKIP_KERNEL_BENCH=1.
set -uo pipefail
OUT=${1:?usage: scripts/gpu_check.sh OUTDIR}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv > "$OUT/gpu.txt" 2>&1
echo "== build"
# The sm90 prefill GEMM needs CUTLASS headers: the nvidia-cutlass package, or ATOMFLOW_CUTLASS_DIR (README).
python3 -c "import cutlass_library" 2>/dev/null || [ -n "${ATOMFLOW_CUTLASS_DIR:-}" ] ||
  echo "gpu_check: no nvidia-cutlass and no ATOMFLOW_CUTLASS_DIR: prefill keeps the mma.sync GEMM"
if ! python3 -m pip install --no-build-isolation --no-deps -e . > "$OUT/build.log" 2>&1; then
  tail -40 "$OUT/build.log"; echo "gpu_check: build failed (log: $OUT/build.log)"; exit 1
fi
grep -E "registers|spill|bytes stack" "$OUT/build.log" > "$OUT/ptxas.txt" 2>/dev/null
rc=0
echo "== GEMV machine code (the built modules)"
python3 tools/sass_check.py --built > "$OUT/sass_check.log" 2>&1
sass_rc=$?
tail -3 "$OUT/sass_check.log"
[ $sass_rc -eq 0 ] || { echo "gpu_check: sass_check failed (exit $sass_rc)"; rc=1; }
if [ "${SKIP_TESTS:-0}" != "1" ]; then
  echo "== pytest -m gpu"
  eval "extra=(${PYTEST_ARGS:-})"  # word-split as the shell would, so a quoted -k expression stays one argument
  if [ -n "${PYTEST_SHARD:-}" ]; then  # every N-th collected test id from the K-th: each share spans every file
    k=${PYTEST_SHARD%/*} n=${PYTEST_SHARD#*/}
    mapfile -t shard < <(python3 -m pytest -m "${PYTEST_MARK:-gpu}" --collect-only -q "${extra[@]}" 2>/dev/null |
      grep "::" | awk -v k="$k" -v n="$n" 'NR % n == k % n')
    [ ${#shard[@]} -gt 0 ] || { echo "gpu_check: shard $PYTEST_SHARD selects no tests"; exit 1; }
    echo "shard $PYTEST_SHARD: ${#shard[@]} tests"
    extra=("${shard[@]}")
  fi
  # The GPU suite is ~1,400 tests, most of them CPU-bound numpy references: spread over workers where
  # pytest-xdist is installed (PYTEST_WORKERS, default 8; 0 runs them in one process).
  workers=()
  python3 -c "import xdist" 2>/dev/null && [ "${PYTEST_WORKERS:-8}" != "0" ] && workers=(-n "${PYTEST_WORKERS:-8}")
  python3 -m pytest -m "${PYTEST_MARK:-gpu}" -q -rfE "${workers[@]}" "${extra[@]}" --junitxml="$OUT/gpu_tests.xml" > "$OUT/gpu_tests.log" 2>&1 || rc=$?
  grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/gpu_tests.log" | tail -25
fi

if [ "${SKIP_KERNEL_BENCH:-0}" != "1" ]; then
  echo "== kernel bench"
  python3 tools/bench_kernels.py --json "$OUT/kernels.json" > "$OUT/kernels.txt" 2>&1 || rc=1
  tail -30 "$OUT/kernels.txt"
fi

echo "== decode timings"
python3 tools/gpu_bench.py --out "$OUT/summary.json" --presets "${PRESETS:-llama-3.2-3b,llama-3.1-8b}" \
  --tests-xml "$OUT/gpu_tests.xml" 2>&1 | tee "$OUT/bench.log" | tail -12 || rc=1
exit $rc
