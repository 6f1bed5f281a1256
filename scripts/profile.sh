#!/usr/bin/env bash
# Nsight reports of the decode step, written to OUTDIR:
#   ncu   per-kernel SpeedOfLight + MemoryWorkloadAnalysis of the GEMV and attention kernels of
#         one eager decode step, GPU clocks left as they run (--clock-control none)
#   nsys  a timeline of N pipelined decode steps (CUDA API, kernels inside the graph, NVTX ranges)
#   bash scripts/profile.sh MODEL [ncu|nsys] [OUTDIR]
# Environment: STEPS (decode steps: ncu 1, nsys 32), CONTEXT (tokens in the cache, default 128),
# EAGER=1 (nsys: eager launches, so each layer's NVTX range shows per step), KERNELS (ncu kernel
# name regex, default gemv|attention), PYTHON (default python3).
set -euo pipefail
MODEL=${1:?usage: scripts/profile.sh MODEL [ncu|nsys] [OUTDIR]}
TOOL=${2:-nsys}
OUT=${3:-profile-$TOOL-$(date +%Y%m%d-%H%M%S)}
PYTHON=${PYTHON:-python3}
CONTEXT=${CONTEXT:-128}
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
DRIVER=("$PYTHON" "$ROOT/tools/profile_steps.py" "$MODEL" --context "$CONTEXT")

die() { echo "profile.sh: $*" >&2; exit 1; }
[ -f "$MODEL" ] || die "no such model file: $MODEL"
mkdir -p "$OUT"

case "$TOOL" in
  ncu)
    command -v ncu > /dev/null || die "ncu (Nsight Compute) not found: it ships with the CUDA toolkit (bin/)"
    ncu --profile-from-start off --clock-control none --target-processes all \
      --kernel-name "regex:${KERNELS:-gemv|attention}" \
      --section SpeedOfLight --section MemoryWorkloadAnalysis \
      --export "$OUT/ncu" --force-overwrite \
      "${DRIVER[@]}" --steps "${STEPS:-1}" --eager --mode decode
    ncu --import "$OUT/ncu.ncu-rep" --page details > "$OUT/ncu_details.txt"
    ncu --import "$OUT/ncu.ncu-rep" --page details --csv > "$OUT/ncu_details.csv"
    echo "profile.sh: $OUT/ncu.ncu-rep (ncu-ui), $OUT/ncu_details.txt, $OUT/ncu_details.csv"
    ;;
  nsys)
    command -v nsys > /dev/null || die "nsys (Nsight Systems) not found: install it or use the CUDA toolkit's"
    eager=()
    [ "${EAGER:-0}" = 1 ] && eager=(--eager)
    nsys profile --trace=cuda,nvtx --cuda-graph-trace=node \
      --capture-range=cudaProfilerApi --capture-range-end=stop \
      --output "$OUT/nsys" --force-overwrite true \
      "${DRIVER[@]}" --steps "${STEPS:-32}" --mode generate "${eager[@]}"
    if ! nsys stats --report cuda_gpu_kern_sum --report nvtx_sum "$OUT/nsys.nsys-rep" > "$OUT/nsys_stats.txt"; then
      echo "profile.sh: nsys stats failed (older nsys report names?); the .nsys-rep is complete" >&2
    fi
    echo "profile.sh: $OUT/nsys.nsys-rep (nsys-ui), $OUT/nsys_stats.txt"
    ;;
  *) die "tool must be ncu or nsys, got '$TOOL'" ;;
esac
