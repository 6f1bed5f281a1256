#!/usr/bin/env bash
# One click from a checkout to a benchmark table: toolchain check -> build -> model -> quantize
# -> validate -> bench against the baselines -> TPOT and speedups. Re-running reuses what exists
# (model directory, .atomflow file, ground truth); every step prints a header, a failure names it.
set -euo pipefail

usage() {
  cat <<'EOF'
usage: bash scripts/bootstrap.sh [--model REPO_ID | --hf-dir DIR | --synthetic [--preset NAME]]
                                 [--workdir DIR] [--skip-build] [--skip-fetch] [--baselines LIST]

  --model REPO_ID   download a Hugging Face Llama model (atomflow download: resumable), then check
                    each weight file's sha256 against the Hub's LFS metadata and write SHA256SUMS
                    (the check is skipped, with a note, offline)
  --hf-dir DIR      use a local Hugging Face model directory
  --synthetic       a random model of the --preset shape (tools/make_tiny_model.py); the default
                    when no model is named and the Hub is unreachable (or HF_HUB_OFFLINE=1)
  --preset NAME     tiny | llama-3.2-1b | llama-3.2-3b (default) | llama-3.1-8b
  --workdir DIR     where models, files and reports go (default ./bootstrap-work)
  --skip-build      do not build/install (atomflow must already be installed)
  --skip-fetch      do not download: use the model already in the workdir
  --baselines LIST  comma list for atomflow bench --baseline (default all: hf, torch-compile,
                    torch-compile-int8, vllm; each that cannot run is reported as skipped), or none
Without a model option: meta-llama/Llama-3.2-3B-Instruct when the Hub is reachable (gated: accept
its license and log in first), else --synthetic. Environment: PYTHON (default python3),
BENCH_ARGS (extra atomflow bench options, e.g. "-r 3 --context 4096").
EOF
}

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYTHON=${PYTHON:-python3}
DEFAULT_REPO=meta-llama/Llama-3.2-3B-Instruct
WORKDIR=./bootstrap-work
REPO=""; HF_DIR=""; SYNTHETIC=0; PRESET=llama-3.2-3b; SKIP_BUILD=0; SKIP_FETCH=0; BASELINES=all

while [ $# -gt 0 ]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --model) REPO=${2:?--model needs a repo id}; shift 2 ;;
    --hf-dir) HF_DIR=${2:?--hf-dir needs a directory}; shift 2 ;;
    --synthetic) SYNTHETIC=1; shift ;;
    --preset) PRESET=${2:?--preset needs a name}; shift 2 ;;
    --workdir) WORKDIR=${2:?--workdir needs a directory}; shift 2 ;;
    --skip-build) SKIP_BUILD=1; shift ;;
    --skip-fetch) SKIP_FETCH=1; shift ;;
    --baselines) BASELINES=${2:?--baselines needs a list}; shift 2 ;;
    *) echo "bootstrap: unknown option $1 (--help lists them)" >&2; exit 1 ;;
  esac
done
if [ $((SYNTHETIC + (${#REPO} > 0) + (${#HF_DIR} > 0))) -gt 1 ]; then
  echo "bootstrap: --model, --hf-dir and --synthetic are alternatives: give one" >&2; exit 1
fi

STEP="setup"
step() { STEP=$1; printf '\n== [%s] %s\n' "$1" "$2"; }
die() { echo "bootstrap: [$STEP] $*" >&2; exit 1; }
on_exit() {
  local rc=$?
  [ "$rc" -eq 0 ] || echo "bootstrap: FAILED in step [$STEP] (exit $rc)" >&2
}
trap on_exit EXIT

mkdir -p "$WORKDIR"
WORKDIR=$(cd "$WORKDIR" && pwd)
cd "$ROOT"

# ---------------------------------------------------------------------------------------------
step toolchain "nvcc, cmake, python >= 3.10, a GPU of compute capability >= 8.9"
command -v "$PYTHON" > /dev/null || die "$PYTHON not found: install Python >= 3.10 (or set PYTHON)"
"$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 10))' ||
  die "$("$PYTHON" -V 2>&1) is too old: atomflow needs Python >= 3.10"
echo "python: $("$PYTHON" -V 2>&1)"
if [ "$SKIP_BUILD" = 0 ]; then
  command -v nvcc > /dev/null || die "nvcc not found: install the CUDA toolkit (12.8 or newer) and put its bin/ on PATH"
  echo "nvcc: $(nvcc --version | tail -1)"
  command -v cmake > /dev/null || die "cmake not found: install CMake >= 3.24 (pip install cmake)"
  echo "cmake: $(cmake --version | sed -n 1p)"
fi
if command -v nvidia-smi > /dev/null; then
  gpu=$(nvidia-smi --query-gpu=name,compute_cap --format=csv,noheader 2>&1 | sed -n 1p) ||
    die "nvidia-smi failed: $gpu (is the NVIDIA driver loaded?)"
  name=${gpu%,*}; cap=$(echo "${gpu##*,}" | tr -d ' ')
  case "$cap" in
    [0-9]*.[0-9]*)
      [ "${cap%.*}" -gt 8 ] || { [ "${cap%.*}" -eq 8 ] && [ "${cap#*.}" -ge 9 ]; } ||
        die "GPU $name has compute capability $cap; atomflow needs >= 8.9 (FP8), and is built for sm_90 only"
      [ "${cap%.*}" -eq 9 ] ||
        die "GPU $name has compute capability $cap; atomflow is built for sm_90 (H100/H200) only"
      echo "gpu: $name (compute capability $cap)" ;;
    *) echo "gpu: nvidia-smi gave no compute capability ($gpu): checked after the build" ;;
  esac
else
  echo "gpu: nvidia-smi not found: the GPU is checked after the build, through atomflow._core"
fi

# ---------------------------------------------------------------------------------------------
step build "pip install (editable)"
if [ "$SKIP_BUILD" = 1 ]; then
  echo "skipped (--skip-build)"
else
  if "$PYTHON" -c 'import scikit_build_core, pybind11, numpy, safetensors, tokenizers, jinja2, ml_dtypes, huggingface_hub, tqdm' 2> /dev/null; then
    cmd=("$PYTHON" -m pip install --no-build-isolation --no-deps -e .)
  else
    cmd=("$PYTHON" -m pip install -e .)
  fi
  echo "${cmd[*]} (log: $WORKDIR/build.log, sm_90)"
  "${cmd[@]}" > "$WORKDIR/build.log" 2>&1 || { tail -30 "$WORKDIR/build.log"; die "build failed (log: $WORKDIR/build.log)"; }
fi
# From here on Python runs outside the checkout: with a non-editable install (pip install .) the
# compiled core is only in site-packages, and the checkout's atomflow/ would shadow it.
cd "$WORKDIR"
"$PYTHON" -c 'from atomflow import _core' 2> /dev/null ||
  die "the CUDA core (atomflow._core) is not installed: build with nvcc on the PATH (log: $WORKDIR/build.log)"

step "gpu check" "a usable GPU, as atomflow._core sees it"
"$PYTHON" - <<'EOF' || die "no usable GPU (atomflow needs an NVIDIA GPU of compute capability >= 8.9)"
import sys
from atomflow import _core
ok, why = _core.cuda_available()
if not ok:
    print(f"gpu: {why}", file=sys.stderr)
    sys.exit(1)
info = _core.device_info()
print(f"gpu: {info['name']} ({info['total_memory'] / 2**30:.0f} GiB), build sm_{_core.build_info()['cuda_arch']}")
EOF

# ---------------------------------------------------------------------------------------------
step model "the Hugging Face model directory"
online() {
  [ "${HF_HUB_OFFLINE:-0}" = 1 ] && return 1
  "$PYTHON" -c 'import os, sys, urllib.request
try:
    urllib.request.urlopen(os.environ.get("HF_ENDPOINT", "https://huggingface.co"), timeout=5)
except Exception:
    sys.exit(1)' 2> /dev/null
}
if [ -z "$REPO$HF_DIR" ] && [ "$SYNTHETIC" = 0 ]; then
  if [ "$SKIP_FETCH" = 0 ] && online; then
    REPO=$DEFAULT_REPO
    echo "no model named: downloading $REPO (--synthetic for a random model)"
  else
    SYNTHETIC=1
    echo "OFFLINE (huggingface.co unreachable, or --skip-fetch): using a SYNTHETIC random $PRESET-shaped model;"
    echo "its speed is real, its text is noise. --model REPO_ID or --hf-dir DIR for real weights."
  fi
fi
if [ -n "$HF_DIR" ]; then
  [ -f "$HF_DIR/config.json" ] || die "$HF_DIR has no config.json: not a Hugging Face model directory"
  NAME=$(basename "$HF_DIR")
elif [ -n "$REPO" ]; then
  NAME=$(basename "$REPO")
  HF_DIR=$WORKDIR/models/$NAME
  if [ -f "$HF_DIR/.bootstrap-complete" ]; then
    echo "reusing $HF_DIR"
  elif [ "$SKIP_FETCH" = 1 ]; then
    [ -f "$HF_DIR/config.json" ] || die "--skip-fetch but $HF_DIR holds no model"
    echo "using $HF_DIR as it is (--skip-fetch)"
  else
    atomflow download "$REPO" --dir "$HF_DIR" || die "download of $REPO failed (re-run to resume)"
    "$PYTHON" "$ROOT/tools/verify_download.py" "$HF_DIR" "$REPO" || die "sha256 verification failed"
    touch "$HF_DIR/.bootstrap-complete"
  fi
else
  NAME=synthetic-$PRESET
  HF_DIR=$WORKDIR/models/$NAME
  if [ -f "$HF_DIR/.bootstrap-complete" ]; then
    echo "reusing $HF_DIR"
  else
    "$PYTHON" "$ROOT/tools/make_tiny_model.py" "$HF_DIR" --preset "$PRESET" || die "making the synthetic model failed"
    touch "$HF_DIR/.bootstrap-complete"
  fi
fi
echo "model: $HF_DIR"

# ---------------------------------------------------------------------------------------------
step quantize "FP8 .atomflow file"
MODEL=$WORKDIR/$NAME.atomflow
if [ -f "$MODEL" ]; then
  echo "reusing $MODEL"
else
  atomflow quantize "$HF_DIR" -o "$MODEL" -q || die "quantize failed"
fi
atomflow info "$MODEL" | sed -n 1,3p

# ---------------------------------------------------------------------------------------------
step validate "every layer against Hugging Face transformers (short ground truth)"
GT=$WORKDIR/ground_truth/$NAME
if ! "$PYTHON" -c 'import torch, transformers' 2> /dev/null; then
  echo "skipped: torch and transformers are not installed (pip install torch transformers)"
else
  if [ -f "$GT/dequant.safetensors" ] && [ -f "$GT/original.safetensors" ]; then
    echo "reusing $GT"
  else
    "$PYTHON" "$ROOT/tools/gen_ground_truth.py" "$HF_DIR" --model "$MODEL" -o "$GT" --steps 4 --prompt-tokens 16 ||
      die "ground truth generation failed"
  fi
  atomflow validate "$MODEL" --ground-truth "$GT" || die "validation FAILED (atomflow validate --all shows every probe)"
fi

# ---------------------------------------------------------------------------------------------
step bench "atomflow bench against the baselines"
bench=(atomflow bench "$MODEL" --hf-dir "$HF_DIR" -o json)
if [ "$BASELINES" != none ]; then
  IFS=, read -r -a names <<< "$BASELINES"
  for b in "${names[@]}"; do bench+=(--baseline "$b"); done
fi
# shellcheck disable=SC2206 # BENCH_ARGS is a list of options, split on purpose
bench+=(${BENCH_ARGS:-})
echo "${bench[*]}"
"${bench[@]}" > "$WORKDIR/bench.json" || die "atomflow bench failed"
"$PYTHON" -c 'import json, sys; from atomflow.bench.report import render
print(render(json.load(open(sys.argv[1])), "md"))' "$WORKDIR/bench.json" | tee "$WORKDIR/bench.md"

# ---------------------------------------------------------------------------------------------
step summary "TPOT and speedups"
"$PYTHON" - "$WORKDIR/bench.json" <<'EOF' | tee "$WORKDIR/summary.md"
import json, sys
r = json.load(open(sys.argv[1]))
ups = {(u["baseline"], u["test"]): u["speedup"] for u in r["speedups"]}
print(f"{r['model']['name']} on {(r.get('device') or {}).get('name')}, read bandwidth {r['read_bandwidth_gbs']:.0f} GB/s\n")
print("| engine | test | TPOT p50 ms | tokens/s | efficiency | atomflow speedup |")
print("|---|---|---:|---:|---:|---:|")
for row in r["rows"]:
    if row["kind"] == "pp":
        continue
    if row["status"] != "ok":
        print(f"| {row['engine']} | {row['test']} | skipped: {row['reason']} | | | |")
        continue
    eff = f"{100 * row['efficiency']:.1f}%" if row["efficiency"] is not None else "-"
    up = ups.get((row["engine"], row["test"]))
    print(f"| {row['engine']} | {row['test']} | {row['tpot_ms_p50']:.3f} | {row['tokens_per_s_avg']:.1f} | {eff} | "
          + (f"{up:.2f}x" if up else "-") + " |")
EOF
echo
echo "bootstrap: done. Reports in $WORKDIR (bench.json, bench.md, summary.md)"
