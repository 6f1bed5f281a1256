"""Load generator for `atomflow serve`, in the spirit of `vllm bench serve`.

    python tools/serve_bench.py [--url http://127.0.0.1:8080] [--api-key KEY] MODE [--json out.json]

modes (any combination; default: load):
  load     --concurrency C --num-requests N --input-len P --output-len G
           N streamed /v1/completions requests of P random token ids each, G tokens out (EOS ignored),
           at most C in flight. Per request TTFT (send to the first token's chunk), TPOT ((last chunk -
           first chunk) / (tokens - 1)), inter-token latency (every gap between chunks, pooled) and
           end-to-end latency; mean / p50 / p99, output tokens/s, rejected (503/504).
  turns    --turns T --first-turn-len P --turn-len U --output-len G [--conversations K]
           K chat conversations of T turns: a long first user turn (about P tokens), then short ones
           (about U tokens); the whole history is sent each turn. TTFT and cached prompt tokens per
           turn (with prefix reuse, TTFT of turns 2.. does not grow with the history).
  cancel   --cancels K
           K streamed requests, each dropped after a few chunks; the time from closing the connection
           to /health saying the engine is free, and the server's own cancel-to-free histogram.

Served TPOT vs the engine's: run `atomflow bench MODEL -p P -n G` and `load --concurrency 1` with the
same P and G, and compare tg TPOT p50 (pooled gaps) with ITL p50 here (and TPOT p50, per request).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time

import httpx
import numpy as np

WORDS = (
    "the cache keeps every key and value of the tokens before so a new token reads them instead of "
    "computing them again which is why decoding one token costs a pass over the weights and the cache "
    "memory bandwidth bounds the speed of a single stream on a modern accelerator"
).split()


def pct(xs, q) -> float:
    return float(np.percentile(xs, q)) if len(xs) else float("nan")


def ms(x: float) -> str:
    return f"{1e3 * x:9.2f}"


async def stream_request(client: httpx.AsyncClient, url: str, path: str, body: dict, headers: dict) -> dict:
    """One streamed request: status, and for a 200 the chunk times, usage and finish reason."""
    t0 = time.perf_counter()
    out = {"status": 0, "t0": t0, "chunks": [], "usage": None, "text": ""}
    async with client.stream("POST", url + path, json=body, headers=headers) as r:
        out["status"] = r.status_code
        if r.status_code != 200:
            await r.aread()
            return out
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            now = time.perf_counter()
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                out["usage"] = chunk["usage"]
            for c in chunk.get("choices") or []:
                delta = c.get("delta")
                has_token = (
                    ("text" in c and c.get("finish_reason") is None)
                    if delta is None
                    else ("content" in delta and "role" not in delta)
                )
                if has_token:
                    out["chunks"].append(now)
                    out["text"] += (delta or {}).get("content") or c.get("text") or ""
    out["end"] = time.perf_counter()
    return out


def timings(res: dict) -> dict | None:
    """TTFT, TPOT, e2e of a finished request (None when it produced no token)."""
    if res["status"] != 200 or not res["chunks"]:
        return None
    n = res["usage"]["completion_tokens"] if res["usage"] else len(res["chunks"])
    first, last = res["chunks"][0], res["chunks"][-1]
    return {
        "ttft": first - res["t0"],
        "tpot": (last - first) / (n - 1) if n > 1 else float("nan"),
        "e2e": res["end"] - res["t0"],
        "tokens": n,
        "prompt_tokens": res["usage"]["prompt_tokens"] if res["usage"] else None,
        "cached_tokens": ((res["usage"] or {}).get("prompt_tokens_details") or {}).get("cached_tokens"),
    }


# -- load ----------------------------------------------------------------------------------------
async def run_load(a, headers) -> dict:
    rnd = random.Random(a.seed)
    sem = asyncio.Semaphore(a.concurrency)
    limits = httpx.Limits(max_connections=a.concurrency + 4, max_keepalive_connections=a.concurrency + 4)

    async with httpx.AsyncClient(timeout=httpx.Timeout(a.timeout), limits=limits) as client:

        async def one(i):
            prompt = [rnd.randrange(a.id_low, a.id_high) for _ in range(a.input_len)]
            body = {
                "prompt": prompt,
                "max_tokens": a.output_len,
                "stream": True,
                "ignore_eos": True,
                "temperature": 0,
                "stream_options": {"include_usage": True},
            }
            if a.model:
                body["model"] = a.model
            async with sem:
                try:
                    return await stream_request(client, a.url, "/v1/completions", body, headers)
                except httpx.HTTPError as e:
                    return {"status": -1, "error": repr(e)}

        if a.warmup:
            await one(-1)
        t0 = time.perf_counter()
        results = await asyncio.gather(*(one(i) for i in range(a.num_requests)))
        wall = time.perf_counter() - t0
    done = [t for t in map(timings, results) if t is not None]
    rejected = sum(r["status"] in (503, 504) for r in results)
    failed = sum(r["status"] not in (200, 503, 504) for r in results)
    out = {
        "mode": "load",
        "concurrency": a.concurrency,
        "requests": a.num_requests,
        "input_len": a.input_len,
        "output_len": a.output_len,
        "completed": len(done),
        "rejected": rejected,
        "failed": failed,
        "wall_s": wall,
        "output_tokens_per_s": sum(t["tokens"] for t in done) / wall,
    }
    for k in ("ttft", "tpot", "e2e"):
        xs = [t[k] for t in done if t[k] == t[k]]
        out[k] = {"mean": float(np.mean(xs)) if xs else float("nan"), "p50": pct(xs, 50), "p99": pct(xs, 99)}
    # inter-token latency: every gap between consecutive chunks, pooled (as `atomflow bench` pools its
    # TPOT samples); one chunk is one token unless the client fell behind
    gaps = [g for r in results if r.get("chunks") for g in np.diff(r["chunks"])]
    out["itl"] = {"mean": float(np.mean(gaps)) if gaps else float("nan"), "p50": pct(gaps, 50), "p99": pct(gaps, 99)}
    print(
        f"load: C={a.concurrency} N={a.num_requests} P={a.input_len} G={a.output_len} | completed {len(done)}, "
        f"rejected {rejected}, failed {failed} | {wall:.2f} s, {out['output_tokens_per_s']:.1f} output tokens/s"
    )
    print(f"{'ms':>6} {'mean':>9} {'p50':>9} {'p99':>9}")
    for k in ("ttft", "tpot", "itl", "e2e"):
        print(f"{k:>6} {ms(out[k]['mean'])} {ms(out[k]['p50'])} {ms(out[k]['p99'])}")
    return out


# -- turns ---------------------------------------------------------------------------------------
def words(rnd: random.Random, n: int) -> str:
    return " ".join(rnd.choice(WORDS) for _ in range(n))


async def run_turns(a, headers) -> dict:
    rows = [[] for _ in range(a.turns)]
    async with httpx.AsyncClient(timeout=httpx.Timeout(a.timeout)) as client:
        for conv in range(a.conversations + (1 if a.warmup else 0)):
            rnd = random.Random(a.seed * 1000 + conv)
            messages = [{"role": "user", "content": words(rnd, a.first_turn_len)}]
            for turn in range(a.turns):
                body = {
                    "messages": messages,
                    "max_tokens": a.output_len,
                    "stream": True,
                    "temperature": 0,
                    "ignore_eos": True,
                    "stream_options": {"include_usage": True},
                }
                if a.model:
                    body["model"] = a.model
                res = await stream_request(client, a.url, "/v1/chat/completions", body, headers)
                if res["status"] != 200:
                    raise SystemExit(f"turn {turn + 1}: HTTP {res['status']}")
                t = timings(res)
                if conv >= (1 if a.warmup else 0):
                    rows[turn].append(t)
                messages = messages + [
                    {"role": "assistant", "content": res["text"]},
                    {"role": "user", "content": words(rnd, a.turn_len)},
                ]
    out = {
        "mode": "turns",
        "conversations": a.conversations,
        "first_turn_len": a.first_turn_len,
        "turn_len": a.turn_len,
        "output_len": a.output_len,
        "turns": [],
    }
    print(
        f"turns: {a.conversations} conversation(s), first turn ~{a.first_turn_len} words, then ~{a.turn_len}, "
        f"{a.output_len} tokens out"
    )
    print(f"{'turn':>4} {'prompt':>7} {'cached':>7} {'prefilled':>9} {'TTFT ms p50':>12} {'TPOT ms p50':>12}")
    for i, ts in enumerate(rows):
        row = {
            "turn": i + 1,
            "prompt_tokens": int(np.median([t["prompt_tokens"] for t in ts])),
            "cached_tokens": int(np.median([t["cached_tokens"] or 0 for t in ts])),
            "ttft_p50": pct([t["ttft"] for t in ts], 50),
            "tpot_p50": pct([t["tpot"] for t in ts], 50),
        }
        out["turns"].append(row)
        print(
            f"{i + 1:>4} {row['prompt_tokens']:>7} {row['cached_tokens']:>7} "
            f"{row['prompt_tokens'] - row['cached_tokens']:>9} {ms(row['ttft_p50']):>12} {ms(row['tpot_p50']):>12}"
        )
    return out


# -- cancel --------------------------------------------------------------------------------------
def metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return float("nan")


def run_cancel(a, headers) -> dict:
    body = {"prompt": [5, 6, 7, 8], "max_tokens": a.cancel_output_len, "stream": True, "ignore_eos": True}
    if a.model:
        body["model"] = a.model
    lat = []
    with httpx.Client(timeout=a.timeout) as health:
        m0 = health.get(a.url + "/metrics", headers=headers).text
        for _ in range(a.cancels):
            with httpx.Client(timeout=a.timeout) as c:
                with c.stream("POST", a.url + "/v1/completions", json=body, headers=headers) as r:
                    if r.status_code != 200:
                        raise SystemExit(f"cancel: HTTP {r.status_code}")
                    lines = r.iter_lines()
                    n = 0
                    for line in lines:
                        n += line.startswith("data: ")
                        if n >= a.cancel_after:
                            break
            t0 = time.perf_counter()  # the connection is closed
            while health.get(a.url + "/health").json()["busy"]:
                time.sleep(0.0005)
            lat.append(time.perf_counter() - t0)
        m1 = health.get(a.url + "/metrics", headers=headers).text
    k = "atomflow_cancel_latency_seconds"
    count = metric(m1, k + "_count") - metric(m0, k + "_count")
    server = (metric(m1, k + "_sum") - metric(m0, k + "_sum")) / count if count else float("nan")
    out = {
        "mode": "cancel",
        "cancels": a.cancels,
        "client_p50": pct(lat, 50),
        "client_p99": pct(lat, 99),
        "client_max": max(lat),
        "server_mean": server,
    }
    print(
        f"cancel: {a.cancels} streams dropped after {a.cancel_after} chunks | client close -> engine free: "
        f"p50 {ms(out['client_p50']).strip()} ms, p99 {ms(out['client_p99']).strip()} ms, max "
        f"{ms(out['client_max']).strip()} ms (one /health round trip included) | server cancel flag -> engine "
        f"free: mean {ms(server).strip()} ms"
    )
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("modes", nargs="*", default=["load"], choices=["load", "turns", "cancel"])
    p.add_argument("--url", default="http://127.0.0.1:8080")
    p.add_argument("--api-key", default=None)
    p.add_argument("--model", default=None, help="model id to send (default: none, the server's)")
    p.add_argument("--concurrency", "-c", type=int, default=1)
    p.add_argument("--num-requests", "-n", type=int, default=20)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--id-low", type=int, default=100, help="random prompt ids are drawn from [low, high)")
    p.add_argument("--id-high", type=int, default=1000)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--conversations", type=int, default=3)
    p.add_argument("--first-turn-len", type=int, default=1500, help="words in the first user turn")
    p.add_argument("--turn-len", type=int, default=24, help="words in each later user turn")
    p.add_argument("--cancels", type=int, default=10)
    p.add_argument("--cancel-after", type=int, default=8, help="chunks read before dropping the stream")
    p.add_argument("--cancel-output-len", type=int, default=2000)
    p.add_argument("--no-warmup", dest="warmup", action="store_false")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--json", default=None, help="write the results here")
    a = p.parse_args(argv)
    headers = {"Authorization": f"Bearer {a.api_key}"} if a.api_key else {}
    try:
        health = httpx.get(a.url + "/health", timeout=10).json()
    except httpx.HTTPError as e:
        print(f"serve_bench: no server at {a.url}: {e}", file=sys.stderr)
        return 1
    print(f"server: {health}")
    results = {"url": a.url, "health": health, "runs": []}
    for mode in a.modes:
        if mode == "load":
            results["runs"].append(asyncio.run(run_load(a, headers)))
        elif mode == "turns":
            results["runs"].append(asyncio.run(run_turns(a, headers)))
        else:
            results["runs"].append(run_cancel(a, headers))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
