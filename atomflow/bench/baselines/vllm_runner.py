"""The vllm baseline: vLLM's offline engine on the HF directory, bf16, prefix caching off (every
repetition recomputes its prompt), greedy, EOS ignored. Its API returns whole requests, so time
is measured per request: pp = a 1-token request (prefill + first token = TTFT), tg = (time of an
n-token request - time of a 1-token one) / (n - 1), one TPOT value per repetition (a mean, so
its p50/p90/p99 are over repetitions, not over single steps)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from atomflow.bench.bandwidth import dense_weight_bytes, prompt_bytes_per_token, token_bytes
from atomflow.bench.baselines import Skip, not_run
from atomflow.bench.plan import BenchOptions, prompt_ids
from atomflow.bench.result import measured_row
from atomflow.model.spec import ModelSpec


def run_vllm(hf_dir: Path, opts: BenchOptions, bandwidth_gbs: float | None, log: Callable[[str], None]) -> list[dict]:
    try:
        from vllm import LLM, SamplingParams
    except Exception as e:  # noqa: BLE001 - ImportError, or a broken install failing on import
        raise Skip(f"vllm is not importable ({type(e).__name__}: {str(e).strip()[:120]})") from None
    spec = ModelSpec.from_hf_dir(hf_dir)
    log(f"vllm: loading {hf_dir}")
    llm = LLM(
        model=str(hf_dir), dtype="bfloat16", max_model_len=opts.max_context + 8, enable_prefix_caching=False, seed=opts.seed
    )
    weights = dense_weight_bytes(spec, "bf16")
    head = spec.vocab_size * spec.hidden_size * 2 + spec.hidden_size * 2

    def request(ids, n: int) -> float:
        params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        t0 = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": [int(i) for i in ids]}], params, use_tqdm=False)
        dt = time.perf_counter() - t0
        got = len(out[0].outputs[0].token_ids)
        if got != n:
            raise RuntimeError(f"vllm generated {got} tokens, asked for {n}")
        return dt

    rows = []
    for test in opts.tests:
        log(f"vllm: {test.name}")
        if (row := not_run("vllm", test)) is not None:
            rows.append(row)
            continue
        ids = prompt_ids(spec.vocab_size, max(test.n_prompt, test.depth + 1), opts.seed)
        tps, tpot, ttft = [], [], []
        for rep in range(opts.repetitions + int(opts.warmup)):
            if test.kind == "pp":
                dt = request(ids, 1)
                sample = (test.n_prompt / dt, None, 1e3 * dt)
            else:
                one, full = request(ids, 1), request(ids, test.n_gen)
                step = (full - one) / (test.n_gen - 1)
                sample = (1.0 / step, [1e3 * step], None)
            if rep >= int(opts.warmup):
                tps.append(sample[0])
                if sample[1]:
                    tpot.append(sample[1])
                if sample[2]:
                    ttft.append(sample[2])
        nbytes = (
            prompt_bytes_per_token(spec, weights, head, test.n_prompt, test.n_prompt)
            if test.kind == "pp"
            else token_bytes(spec, weights, test.mean_context)
        )
        rows.append(
            measured_row(
                "vllm",
                test,
                tps,
                tpot or None,
                ttft or None,
                nbytes,
                bandwidth_gbs,
                weight_dtype="bf16",
                tpot_method="per-request mean",
            )
        )
    return rows
