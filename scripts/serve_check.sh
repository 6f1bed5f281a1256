#!/usr/bin/env bash
# Serving on one GPU, measured: the engine's tg TPOT (`atomflow bench`) against the TPOT a client
# sees over SSE at concurrency 1, TTFT of chat turns 1-6 after a long first turn, and how soon the
# engine is free after a client drops its stream. Writes OUTDIR/*.json and prints a summary last.
#   bash scripts/serve_check.sh MODEL.atomflow OUTDIR
# Environment: PORT (default 8090), N_PROMPT (128), N_GEN (256), REQUESTS (20), FIRST_TURN (3000 words),
# BACKEND (auto), MAX_CONTEXT (8192), PYTHON (python3).
set -uo pipefail
MODEL=${1:?usage: scripts/serve_check.sh MODEL.atomflow OUTDIR}
OUT=${2:?usage: scripts/serve_check.sh MODEL.atomflow OUTDIR}
PY=${PYTHON:-python3}
PORT=${PORT:-8090}
P=${N_PROMPT:-128}
G=${N_GEN:-256}
MODEL=$(realpath "$MODEL")
mkdir -p "$OUT"
OUT=$(realpath "$OUT")
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
URL="http://127.0.0.1:$PORT"

echo "== atomflow bench -p $P -n $G"
$PY -m atomflow.cli bench "$MODEL" -p "$P" -n "$G" -r 5 -o json > "$OUT/bench.json" 2> "$OUT/bench.log" \
  || { tail -5 "$OUT/bench.log"; echo "serve_check: bench failed"; }

echo "== atomflow serve on $URL"
$PY -m atomflow.cli serve "$MODEL" --port "$PORT" --backend "${BACKEND:-auto}" --max-context "${MAX_CONTEXT:-8192}" \
  > "$OUT/serve.log" 2>&1 &
pid=$!
trap 'kill $pid 2>/dev/null; wait $pid 2>/dev/null' EXIT
for _ in $(seq 600); do
  curl -sf "$URL/health" > /dev/null && break
  kill -0 $pid 2>/dev/null || { tail -5 "$OUT/serve.log"; echo "serve_check: the server exited"; exit 1; }
  sleep 0.5
done

$PY tools/serve_bench.py --url "$URL" load -c 1 -n "${REQUESTS:-20}" --input-len "$P" --output-len "$G" \
  --json "$OUT/serve_load.json" | tee "$OUT/serve_load.txt"
$PY tools/serve_bench.py --url "$URL" turns --turns 6 --conversations 3 --first-turn-len "${FIRST_TURN:-3000}" \
  --turn-len 24 --output-len 32 --json "$OUT/serve_turns.json" | tee "$OUT/serve_turns.txt"
$PY tools/serve_bench.py --url "$URL" cancel --cancels 20 --json "$OUT/serve_cancel.json" | tee "$OUT/serve_cancel.txt"
$PY tools/serve_bench.py --url "$URL" load -c 8 -n 64 --input-len "$P" --output-len 64 \
  --json "$OUT/serve_load_c8.json" > "$OUT/serve_load_c8.txt"
curl -s "$URL/metrics" > "$OUT/metrics.txt"

echo "== summary"
$PY - "$OUT" <<'EOF'
import json, sys
out = sys.argv[1]
try:
    rows = json.load(open(f"{out}/bench.json"))["rows"]
    tg = next(r for r in rows if r["engine"] == "atomflow" and r["kind"] == "tg" and r["status"] == "ok")
    bench = tg["tpot_ms_p50"]
except Exception as e:  # bench failed or has no tg row
    bench, tg = None, {"test": f"(no bench: {e})"}
load = json.load(open(f"{out}/serve_load.json"))["runs"][0]
served, itl = 1e3 * load["tpot"]["p50"], 1e3 * load["itl"]["p50"]
turns = json.load(open(f"{out}/serve_turns.json"))["runs"][0]["turns"]
cancel = json.load(open(f"{out}/serve_cancel.json"))["runs"][0]
print(f"engine tg TPOT p50 ({tg['test']}): {bench if bench is None else f'{bench:.3f} ms'}")
print(f"served (SSE, concurrency 1, {load['input_len']} in / {load['output_len']} out): TPOT p50 {served:.3f} ms"
      + (f" ({100 * (served / bench - 1):+.1f}% vs the engine; target within 3%)" if bench else "")
      + f", inter-token p50 {itl:.3f} ms" + (f" ({100 * (itl / bench - 1):+.1f}%)" if bench else ""))
print("TTFT by chat turn (ms p50): " + ", ".join(f"{t['turn']}: {1e3 * t['ttft_p50']:.1f}" for t in turns)
      + f"  (prompt {turns[0]['prompt_tokens']} -> {turns[-1]['prompt_tokens']} tokens)")
print(f"cancel: client close -> engine free p50 {1e3 * cancel['client_p50']:.1f} ms, p99 "
      f"{1e3 * cancel['client_p99']:.1f} ms; server flag -> free {1e3 * cancel['server_mean']:.2f} ms mean")
json.dump(dict(engine_tpot_ms=bench, served_tpot_ms=served, served_itl_ms=itl, turns=turns, cancel=cancel),
          open(f"{out}/serve_summary.json", "w"), indent=2)
EOF
