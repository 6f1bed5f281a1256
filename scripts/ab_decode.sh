#!/usr/bin/env bash
# Decode TPOT of this checkout against a base commit, in one GPU call, interleaved (base, new,
# base, new ...) so both see the same machine, clocks and stream-read ceiling.
#   git archive --format=tar.gz -o .base/base.tar.gz BASE_COMMIT    # on a machine with the repo
#   bash scripts/ab_decode.sh .base/base.tar.gz OUTDIR
# Environment: PRESETS (default llama-3.2-3b,llama-3.1-8b), ROUNDS (default 2).
# Each tree is built into its own --target directory and run with PYTHONPATH pointing at it (checked:
# the script stops if a run would import the other tree's package). Prints one table last.
set -uo pipefail
BASE=${1:?usage: scripts/ab_decode.sh BASE_TARBALL OUTDIR}
OUT=${2:?usage: scripts/ab_decode.sh BASE_TARBALL OUTDIR}
BASE=$(realpath "$BASE")
mkdir -p "$OUT"
OUT=$(realpath "$OUT")
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
WORK=${AB_WORKDIR:-/tmp/atomflow-ab}
rm -rf "$WORK/base-src" "$WORK/base-site" "$WORK/new-site"
mkdir -p "$WORK/base-src"
tar -xzf "$BASE" -C "$WORK/base-src"

build() {  # src target log
  (cd "$1" && python3 -m pip install --no-build-isolation --no-deps --target "$2" . > "$3" 2>&1) ||
    { tail -30 "$3"; echo "ab_decode: build of $1 failed (log: $3)"; exit 1; }
}
echo "== build base and new"
build "$WORK/base-src" "$WORK/base-site" "$OUT/build_base.log"
build "$PWD" "$WORK/new-site" "$OUT/build_new.log"

run() {  # name site tree round
  local where
  where=$(cd /tmp && PYTHONPATH="$2" python3 -c "import atomflow; print(atomflow.__file__)")
  case "$where" in "$2"/*) ;; *) echo "ab_decode: $1 would import $where, not $2/"; exit 1 ;; esac
  (cd /tmp && PYTHONPATH="$2" python3 "$3/tools/gpu_bench.py" --out "$OUT/$1_$4.json" \
    --presets "${PRESETS:-llama-3.2-3b,llama-3.1-8b}" --workdir "$WORK/models" > "$OUT/$1_$4.log" 2>&1) ||
    { tail -20 "$OUT/$1_$4.log"; echo "ab_decode: $1 round $4 failed"; exit 1; }
}
for r in $(seq 1 "${ROUNDS:-2}"); do
  echo "== round $r"
  run base "$WORK/base-site" "$WORK/base-src" "$r"
  run new "$WORK/new-site" "$PWD" "$r"
done

python3 - "$OUT" <<'EOF'
import glob, json, sys
from collections import defaultdict
out = sys.argv[1]
rows, bw, dev = defaultdict(lambda: defaultdict(list)), defaultdict(list), None
for path in sorted(glob.glob(f"{out}/base_*.json") + glob.glob(f"{out}/new_*.json")):
    name = path.rsplit("/", 1)[1].split("_")[0]
    s = json.load(open(path))
    dev = s["device"].get("name")
    bw[name].append(s["read_bandwidth_gbs"])
    for model, r in s["models"].items():
        rows[model][name].append(r["tpot_ms_p50"])
summary = {"device": dev, "read_bandwidth_gbs": bw, "tpot_ms_p50": rows}
json.dump(summary, open(f"{out}/ab_summary.json", "w"), indent=2)
print(f"\nab_decode on {dev}; read bandwidth base {bw['base']} new {bw['new']} GB/s")
print(f"{'model/mode':<24} {'base p50 (each round)':>26} {'new p50 (each round)':>26} {'new/base':>9}")
for model, by in rows.items():
    b, n = by["base"], by["new"]
    print(f"{model:<24} {' '.join(f'{v:.3f}' for v in b):>26} {' '.join(f'{v:.3f}' for v in n):>26} "
          f"{min(n) / min(b):9.4f}")
EOF
