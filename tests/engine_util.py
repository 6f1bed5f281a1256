"""The engine tests' shared helpers: the CUDA engine and the numpy reference backend on one file, and
the logits comparison every rung of the correctness ladder uses (tests/test_engine_gpu.py,
tests/test_architectures_gpu.py)."""

from __future__ import annotations

import numpy as np

from atomflow.model.fileformat import AtomflowFile

COS_MIN, REL_L2_MAX = 0.9999, 1e-2  # bf16 activations and KV cache vs an fp32 reference


def cos_rel(got: np.ndarray, want: np.ndarray) -> tuple[float, float]:
    got, want = got.astype(np.float64), want.astype(np.float64)
    cos = float(got @ want / (np.linalg.norm(got) * np.linalg.norm(want)))
    return cos, float(np.linalg.norm(got - want) / np.linalg.norm(want))


def assert_close(got: np.ndarray, want: np.ndarray, what: str) -> None:
    assert got.shape == want.shape and got.dtype == np.float32, f"{what}: {got.shape} {got.dtype}"
    assert np.isfinite(got).all(), f"{what}: non-finite logits"
    cos, rel = cos_rel(got, want)
    assert cos >= COS_MIN and rel <= REL_L2_MAX, f"{what}: cosine {cos:.6f}, rel-L2 {rel:.2e}"


def cuda(model: AtomflowFile, max_context: int, **kw):
    from atomflow.backends.cuda import CudaBackend

    return CudaBackend(model, max_context, verbose=False, **kw)


def cpu(model: AtomflowFile, max_context: int):
    from atomflow.backends.cpu import CpuBackend

    return CpuBackend(model, max_context)


def prompt(n: int, vocab: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, n).astype(np.int32)


def greedy(n: int):
    from atomflow.sampling import SamplingParams

    return SamplingParams(temperature=0.0, max_new_tokens=n, seed=0)


def assert_graph_and_eager_agree(model: AtomflowFile, n: int) -> None:
    """The same greedy tokens from the CUDA-graph and the eager engine (n of them after a 50-token
    prompt), and the same logits after a rollback."""
    ids = prompt(50, model.spec.vocab_size, seed=2)
    graph, eager = cuda(model, 256), cuda(model, 256, eager=True)
    assert graph.engine.graph_enabled and not eager.engine.graph_enabled
    a, b = list(graph.generate_ids(ids, greedy(n))), list(eager.generate_ids(ids, greedy(n)))
    assert a == b
    graph.rollback(60)
    eager.rollback(60)
    _, rel = cos_rel(graph.decode(a[10]), eager.decode(a[10]))
    assert rel <= 1e-5
