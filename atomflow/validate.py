"""`atomflow validate`: the engine's per-layer activations against Hugging Face dumps.

Ground truth (tools/gen_ground_truth.py) holds HF fp32 probes for a prompt and greedy decode
steps, from two references: the file's dequantized weights (kernel error: must be tiny) and
the original checkpoint (quantization error: must be small). The engine replays the same
tokens with probes on (eager, never inside the graph), and every (probe, layer, phase) is
compared over its positions: cosine (the worst position), rel-L2 and max-abs.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from atomflow.errors import AtomflowError

LAYER_PROBES = ("attn_norm", "attn_out", "resid_mid", "mlp_out", "layer_out")
# (PASS at cosine >=, WARN at >=); below WARN is FAIL.
THRESHOLDS = {"dequant": (0.9999, 0.999), "original": (0.99, 0.95)}


@dataclass
class Row:
    reference: str
    probe: str
    layer: int  # -1 for final_norm / logits
    phase: str  # "prompt" (positions 0..P-1) or "decode" (P..)
    positions: int
    cosine: float  # worst position
    rel_l2: float  # worst position
    max_abs: float
    verdict: str


@dataclass
class GroundTruth:
    reference: str
    prompt: list[int]
    decode: list[int]
    checksum: str
    tensors: dict[str, np.ndarray]
    meta: dict[str, str]


def load_ground_truth(path: str | Path) -> list[GroundTruth]:
    from safetensors import safe_open
    from safetensors.numpy import load_file

    path = Path(path)
    files = [path / f"{r}.safetensors" for r in THRESHOLDS if (path / f"{r}.safetensors").is_file()]
    if not path.is_dir() or not files:
        raise AtomflowError(
            f"{path}: no ground truth here (expected dequant.safetensors and/or "
            f"original.safetensors from tools/gen_ground_truth.py)"
        )
    out = []
    for f in files:
        with safe_open(str(f), "numpy") as h:
            meta = h.metadata() or {}
        if meta.get("format") != "atomflow-ground-truth-1":
            raise AtomflowError(f"{f}: not an atomflow ground-truth file")
        out.append(
            GroundTruth(
                meta["reference"],
                json.loads(meta["prompt_ids"]),
                json.loads(meta["decode_ids"]),
                meta["model_checksum"],
                load_file(str(f)),
                meta,
            )
        )
    return out


def engine_probes(engine, prompt: list[int], decode: list[int]) -> dict[str, np.ndarray]:
    """The engine's probes over prompt + decode, stacked to [positions, dim] like the dumps.
    final_norm and logits exist for the last position of each call (prompt end, each step)."""
    engine.reset()
    calls = [engine.backend.probed_prefill(np.asarray(prompt, dtype=np.int32))]
    calls += [engine.backend.probed_decode(int(t)) for t in decode]
    names = set().union(*(c.keys() for c in calls))
    return {n: np.concatenate([c[n] for c in calls], axis=0) for n in names}


def _metrics(got: np.ndarray, want: np.ndarray) -> tuple[float, float, float]:
    got, want = got.astype(np.float64), want.astype(np.float64)
    num = np.sum(got * want, axis=-1)
    den = np.linalg.norm(got, axis=-1) * np.linalg.norm(want, axis=-1)
    cos = np.where(den > 0, num / np.where(den > 0, den, 1), 1.0)
    rel = np.linalg.norm(got - want, axis=-1) / np.maximum(np.linalg.norm(want, axis=-1), 1e-30)
    if not (np.isfinite(got).all()):
        return float("nan"), float("inf"), float("inf")
    return float(cos.min()), float(rel.max()), float(np.abs(got - want).max())


def compare(gt: GroundTruth, probes: dict[str, np.ndarray], num_layers: int) -> list[Row]:
    p_len, n_dec = len(gt.prompt), len(gt.decode)
    pass_at, warn_at = THRESHOLDS[gt.reference]
    rows = []

    def add(probe, layer, phase, got, want):
        cos, rel, mx = _metrics(got, want)
        verdict = "PASS" if cos >= pass_at else "WARN" if cos >= warn_at else "FAIL"
        rows.append(Row(gt.reference, probe, layer, phase, len(want), cos, rel, mx, verdict))

    for layer in range(num_layers):
        for probe in LAYER_PROBES:
            key = f"{probe}.{layer}"
            got, want = probes[probe][layer], gt.tensors[key]
            add(probe, layer, "prompt", got[:p_len], want[:p_len])
            if n_dec:
                add(probe, layer, "decode", got[p_len:], want[p_len:])
    # final_norm/logits: the engine computes the last position of each call only.
    last = [p_len - 1] + list(range(p_len, p_len + n_dec))
    for probe in ("final_norm", "logits"):
        got, want = probes[probe], gt.tensors[probe][last]
        add(probe, -1, "prompt", got[:1], want[:1])
        if n_dec:
            add(probe, -1, "decode", got[1:], want[1:])
    return rows


def validate(engine, ground_truth: str | Path) -> list[Row]:
    refs = load_ground_truth(ground_truth)
    checksum = engine.model.checksum
    rows = []
    cache: dict[tuple, dict] = {}
    for gt in refs:
        if gt.checksum != checksum:
            raise AtomflowError(
                f"ground truth in {ground_truth} was made from another model file "
                f"(its checksum {gt.checksum[:19]}..., this file {checksum[:19]}...)"
            )
        key = (tuple(gt.prompt), tuple(gt.decode))
        if key not in cache:
            flat = engine_probes(engine, gt.prompt, gt.decode)
            cache[key] = _per_layer(flat, engine.spec.num_layers)
        rows += compare(gt, cache[key], engine.spec.num_layers)
    return rows


def _per_layer(flat: dict[str, np.ndarray], num_layers: int) -> dict:
    """{"attn_norm.3": [T, d], ...} -> {"attn_norm": [layer -> [T, d]], ..., "logits": [T, vocab]}."""
    out: dict = {p: [flat[f"{p}.{i}"] for i in range(num_layers)] for p in LAYER_PROBES}
    out["final_norm"], out["logits"] = flat["final_norm"], flat["logits"]
    return out


def format_table(rows: list[Row]) -> str:
    lines = [
        f"{'reference':<9} {'probe':<10} {'layer':>5} {'position':<8} {'n':>3} {'cosine':>10} "
        f"{'rel-L2':>9} {'max-abs':>9}  verdict"
    ]
    for r in rows:
        layer = "-" if r.layer < 0 else str(r.layer)
        lines.append(
            f"{r.reference:<9} {r.probe:<10} {layer:>5} {r.phase:<8} {r.positions:>3} {r.cosine:10.6f} "
            f"{r.rel_l2:9.2e} {r.max_abs:9.2e}  {r.verdict}"
        )
    return "\n".join(lines)


def verdict_line(rows: list[Row]) -> str:
    n = len(rows)
    counts = {v: sum(r.verdict == v for r in rows) for v in ("PASS", "WARN", "FAIL")}
    first_fail = next((r for r in rows if r.verdict == "FAIL"), None)
    s = f"{counts['PASS']}/{n} PASS, {counts['WARN']} WARN, {counts['FAIL']} FAIL"
    if first_fail:
        where = "final" if first_fail.layer < 0 else f"layer {first_fail.layer}"
        s += f" (first FAIL: {first_fail.reference} {first_fail.probe} at {where}, {first_fail.phase})"
    return s


def rows_json(rows: list[Row]) -> str:
    return json.dumps([asdict(r) for r in rows], indent=1)
