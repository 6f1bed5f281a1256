"""`atomflow bench`: llama-bench-style tests on our engine, then on each requested baseline, in one
process and against one read-bandwidth measurement; returns the result dict (result.py)
that report.py renders.

Order matters for memory: the streaming-read probe (2 GiB, freed) first, then our engine (freed),
then the torch baselines one at a time, vLLM last (it keeps most of the GPU once started).
"""

from __future__ import annotations

import gc
import sys
from collections.abc import Callable
from pathlib import Path

from atomflow import runinfo
from atomflow.bench import baselines
from atomflow.bench.plan import BenchOptions, check_fits_model
from atomflow.bench.result import SCHEMA, speedups
from atomflow.device import cuda_status
from atomflow.errors import BackendUnavailableError
from atomflow.model.fileformat import AtomflowFile

W8A8_ENGINE = "atomflow w8a8"  # the pp rows of --prefill-fp8 (the FP8 prefill recipe)


def log_stderr(msg: str) -> None:
    print(f"atomflow bench: {msg}", file=sys.stderr, flush=True)


def recorded_hf_dir(model: AtomflowFile) -> str | None:
    """The HF directory the file was quantized from (its `source.path`), if it still exists."""
    path = (model.metadata_json("source", {}) or {}).get("path")
    return path if path and Path(path, "config.json").is_file() else None


def preflight(opts: BenchOptions) -> AtomflowFile:
    """Everything that can be checked without a GPU: the file, the positions every test needs,
    then whether the CUDA backend can run at all. Raises with a one-line message."""
    model = AtomflowFile(opts.model)
    check_fits_model(opts, model.spec.max_position_embeddings)
    ok, why = cuda_status()
    if not ok:
        raise BackendUnavailableError(f"cuda backend unavailable: {why}")
    return model


def run_bench(opts: BenchOptions, log: Callable[[str], None] = log_stderr) -> dict:
    from atomflow.bench.bandwidth import read_bandwidth_gbs
    from atomflow.bench.engine import run_engine_tests
    from atomflow.engine import Engine

    model = preflight(opts)
    hf_dir = opts.hf_dir or recorded_hf_dir(model)
    log("measuring the read bandwidth (streaming-read kernel)")
    bandwidth = read_bandwidth_gbs()
    log(f"loading {opts.model} with max_context {opts.max_context}")
    try:
        eng = Engine.load(opts.model, backend="cuda", max_context=opts.max_context)
    except RuntimeError as e:
        if "not enough GPU memory" in str(e):
            raise RuntimeError(f"the tests need max_context {opts.max_context}: {e}") from None
        raise
    rows = run_engine_tests(eng, opts, bandwidth, log)
    del eng
    gc.collect()
    if opts.prefill_fp8 and any(t.kind == "pp" for t in opts.tests):
        log(f"loading {opts.model} with the FP8 prefill recipe (prefill_recipe w8a8)")
        eng = Engine.load(opts.model, backend="cuda", max_context=opts.max_context, prefill_recipe="w8a8")
        rows += run_engine_tests(eng, opts, bandwidth, log, engine=W8A8_ENGINE, kinds=("pp",))
        del eng
        gc.collect()
    if opts.speculate:
        from atomflow.bench.engine import run_speculate_tests

        log(f"loading {opts.model} for --speculate {opts.speculate}")
        eng = Engine.load(opts.model, backend="cuda", max_context=opts.max_context, speculate=opts.speculate)
        rows += run_speculate_tests(eng, opts, bandwidth, log)
        del eng
        gc.collect()

    order = [b for b in opts.baselines if b != "vllm"] + [b for b in opts.baselines if b == "vllm"]
    for name in order:
        rows += baselines.run(name, hf_dir, opts, bandwidth, log)

    return dict(
        schema=SCHEMA,
        date=runinfo.now(),
        commit=runinfo.commit(),
        versions=runinfo.versions(with_torch=bool(opts.baselines)),
        device=runinfo.device(),
        read_bandwidth_gbs=bandwidth,
        model=dict(
            path=str(Path(opts.model).resolve()),
            name=Path(opts.model).name,
            spec=model.spec.to_dict(),
            weight_bytes=model.weight_bytes,
            quantization=model.quantization,
        ),
        hf_dir=str(hf_dir) if hf_dir else None,
        options=dict(
            n_prompt=list(opts.n_prompt),
            n_gen=list(opts.n_gen),
            contexts=list(opts.contexts),
            repetitions=opts.repetitions,
            warmup=opts.warmup,
            seed=opts.seed,
            max_context=opts.max_context,
            compile_prefill=opts.compile_prefill,
            speculate=opts.speculate,
            prefill_fp8=opts.prefill_fp8,
        ),
        tests=[t.name for t in opts.tests],
        baselines=list(order),
        rows=rows,
        speedups=speedups(rows) + (speedups(rows, W8A8_ENGINE) if opts.prefill_fp8 else []),
    )
