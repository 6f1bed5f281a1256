"""HF directory (Llama, Mistral, Qwen2, Qwen3) or GGUF file -> one .atomflow file (docs/FORMAT.md).

Reads the sharded safetensors lazily, a block of rows at a time, so peak memory stays near
one chunk of one tensor (tens of MiB), not the model. FP8 rounding is ml_dtypes'
float8_e4m3fn (round to nearest even); values are clipped to +-448 first because ml_dtypes
turns overflow into NaN rather than saturating.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import re
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import ml_dtypes
import numpy as np

from atomflow import __version__
from atomflow.errors import UnsupportedModelError
from atomflow.model import quantize_io
from atomflow.model.fileformat import FORMAT_NAME, FORMAT_VERSION, FileWriter, dequantize_rows, expected_tensors, temp_path
from atomflow.model.spec import QUANT_GROUP, ModelSpec, scale_groups

FP8_MAX = 448.0
CHUNK_BYTES = 8 << 20  # fp32 bytes of one row block
MAX_THREADS = 8  # row blocks quantized in parallel (numpy releases the GIL); bounds memory too
SOURCE_DTYPES = {"BF16": "bf16", "F16": "fp16", "F32": "fp32"}
SOURCE_FILE = ".atomflow-source.json"  # written by `atomflow download`: repo id and revision


def quantize_rows(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """fp32 [n, k] -> (fp8 e4m3fn [n, k], fp32 scales [n, ceil(k / 128)]); scale = absmax / 448 per
    group of 128 columns, the last group covering the k % 128 columns left over (if any)."""
    n, k = w.shape
    groups = scale_groups(k)
    pad = groups * QUANT_GROUP - k
    g = (np.pad(w, ((0, 0), (0, pad))) if pad else w).reshape(n, groups, QUANT_GROUP)  # zeros: absmax unchanged
    scale = np.abs(g).max(axis=-1) / np.float32(FP8_MAX)
    scale[scale == 0] = 1.0  # an all-zero group: any scale dequantizes to zero
    q = np.clip(g / scale[..., None], -FP8_MAX, FP8_MAX).astype(ml_dtypes.float8_e4m3fn)
    q = q.reshape(n, groups * QUANT_GROUP)
    return (np.ascontiguousarray(q[:, :k]) if pad else q), scale.astype(np.float32)


class _Source:
    """Lazy access to the tensors of an HF checkpoint (one or many safetensors shards)."""

    def __init__(self, hf_dir: Path):
        index = hf_dir / "model.safetensors.index.json"
        if index.is_file():
            weight_map = quantize_io.weight_map(index)
        else:
            shards = sorted(hf_dir.glob("*.safetensors"))
            if not shards:
                raise FileNotFoundError(f"{hf_dir}: no *.safetensors weights (PyTorch .bin checkpoints are not supported)")
            weight_map = {}
            for shard in shards:
                with quantize_io.open_shard(shard) as f:
                    weight_map.update({k: shard.name for k in f.keys()})
        self.dir, self.weight_map = hf_dir, weight_map
        self.dtypes: set[str] = set()

    @contextlib.contextmanager
    def slice(self, name: str):
        """The tensor's lazy slice. The shard is opened for this tensor only: safetensors maps the
        file, and pages a mapping touched count as ours until it is closed, so a shard held
        open would grow the process by the whole checkpoint."""
        if name not in self.weight_map:
            raise UnsupportedModelError(f"{self.dir}: checkpoint has no tensor {name!r}")
        path = self.dir / self.weight_map[name]
        if not path.is_file():
            raise FileNotFoundError(f"{path}: shard named in the index is missing")
        with quantize_io.open_shard(path) as f:
            sl = f.get_slice(name)
            dt = sl.get_dtype()
            if dt not in SOURCE_DTYPES:
                raise UnsupportedModelError(f"{name}: source dtype {dt} (supported: bf16, fp16, fp32)")
            self.dtypes.add(SOURCE_DTYPES[dt])
            yield sl

    def dtype(self, name: str) -> str:
        with self.slice(name) as sl:
            return sl.get_dtype()

    def rows(self, name: str, shape: tuple[int, ...]):
        """Yields fp32 row blocks of a 2-D tensor, checking its shape."""
        with self.slice(name) as sl:
            got = tuple(sl.get_shape())
            if got != shape:
                raise UnsupportedModelError(f"{name}: shape {list(got)}, config.json implies {list(shape)}")
            step = max(1, CHUNK_BYTES // (4 * shape[-1]))
            for a in range(0, shape[0], step):
                yield self._finite(name, np.asarray(sl[a : min(a + step, shape[0])], dtype=np.float32), a)

    def vector(self, name: str, n: int) -> np.ndarray:
        with self.slice(name) as sl:
            if tuple(sl.get_shape()) != (n,):
                raise UnsupportedModelError(f"{name}: shape {sl.get_shape()}, config.json implies [{n}]")
            return self._finite(name, np.asarray(sl[:], dtype=np.float32), 0)

    def _finite(self, name: str, block: np.ndarray, row0: int) -> np.ndarray:
        """NaN / Inf in a source weight would quantize to NaN scales: a file no reader takes."""
        if not np.isfinite(block).all():
            row = row0 + int(np.argwhere(~np.isfinite(block))[0][0])
            raise UnsupportedModelError(f"{self.dir / self.weight_map[name]}: tensor {name!r} holds NaN or Inf (row {row})")
        return block


@dataclass
class _ErrStats:
    """Relative quantization error ||W - W'|| / ||W|| of each matrix, accumulated over row blocks."""

    err: dict[str, list[float]] = field(default_factory=dict)

    def add(self, key: str, sums: tuple[float, float]) -> None:
        e = self.err.setdefault(key, [0.0, 0.0])
        e[0] += sums[0]
        e[1] += sums[1]

    @staticmethod
    def sums(w: np.ndarray, q: np.ndarray, s: np.ndarray) -> tuple[float, float]:
        return (float(np.square(w - dequantize_rows(q, s)).sum(dtype=np.float64)), float(np.square(w).sum(dtype=np.float64)))

    def rel(self, key: str) -> float:
        num, den = self.err[key]
        return float(np.sqrt(num / den)) if den > 0 else 0.0


def _metadata(hf_dir: Path, spec: ModelSpec, lm_head: str, source_dtype: str) -> dict[str, str]:
    def read_json(name: str) -> dict:
        return quantize_io.read_json_object(hf_dir / name, missing_ok=True)

    tok = hf_dir / "tokenizer.json"
    if not tok.is_file():
        raise FileNotFoundError(f"{hf_dir}: no tokenizer.json (a Hugging Face fast tokenizer is required)")
    tok_cfg = read_json("tokenizer_config.json")
    chat_template = tok_cfg.get("chat_template") or ""
    template_src = "tokenizer_config.json" if chat_template else ""
    if (hf_dir / "chat_template.jinja").is_file():
        chat_template, template_src = quantize_io.read_text(hf_dir / "chat_template.jinja"), "chat_template.jinja"
    if isinstance(chat_template, list):  # named templates: take the default one
        chat_template = next((t.get("template") for t in chat_template if isinstance(t, dict) and t.get("name") == "default"), "")
    if not isinstance(chat_template, str):
        raise UnsupportedModelError(
            f"{hf_dir / 'tokenizer_config.json'}: chat_template must be a string or a list of "
            f"named templates, got {chat_template!r:.60}"
        )

    def token_text(key: str):
        v = tok_cfg.get(key)
        v = v.get("content") if isinstance(v, dict) else v
        if v is not None and not isinstance(v, str):
            raise UnsupportedModelError(f"{hf_dir / 'tokenizer_config.json'}: {key} must be a string, got {v!r:.60}")
        return v

    config, gen = read_json("config.json"), read_json("generation_config.json")
    generation = quantize_io.generation_config(hf_dir, config, gen, spec.vocab_size)
    source = read_json(SOURCE_FILE)
    return {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "spec": spec.to_json(),
        "quantization": json.dumps(
            dict(scheme="fp8_e4m3fn_w8a16", group_size=QUANT_GROUP, scale_dtype="F32", lm_head=lm_head, source_dtype=source_dtype)
        ),
        "tokenizer": quantize_io.read_text(tok),
        "tokenizer_config": json.dumps(
            dict(
                bos_token=token_text("bos_token"),
                eos_token=token_text("eos_token"),
                add_bos_token=tok_cfg.get("add_bos_token") is True,
                chat_template_source=template_src,
            )
        ),
        "chat_template": chat_template,
        "generation_config": json.dumps(generation),
        "source": json.dumps(dict(repo_id=source.get("repo_id"), revision=source.get("revision"), path=str(hf_dir.resolve()))),
        "created_by": f"atomflow {__version__}",
    }


def resolve_hf_dir(model: str | Path) -> Path:
    """A local HF directory, or a repo id already in the local Hugging Face cache."""
    p = Path(model)
    if p.is_dir():
        return p
    if re.fullmatch(r"[\w.-]+/[\w.-]+", str(model)) and not p.exists():  # looks like org/name
        from huggingface_hub import snapshot_download

        try:
            return Path(snapshot_download(str(model), local_files_only=True))
        except Exception:
            raise FileNotFoundError(
                f"{model}: not a local directory, and not in the Hugging Face cache "
                f"(run `atomflow download {model} --dir DIR` first)"
            ) from None
    raise FileNotFoundError(f"no such model directory: {model}")


def open_source(model: str | Path, lm_head_fp8: bool = True):
    """(spec, tensor source, metadata function) of an HF directory or a .gguf file, checked: an
    unsupported model fails here, before anything is written."""
    if str(model).lower().endswith(".gguf"):
        from atomflow.model.gguf import GGUFSource

        src = GGUFSource(model, lm_head_fp8=lm_head_fp8)
        return src.spec, src, src.metadata
    hf_dir = resolve_hf_dir(model)
    if not (hf_dir / "config.json").is_file():
        raise FileNotFoundError(f"no config.json in {hf_dir}")
    try:
        spec = ModelSpec.from_hf_config(quantize_io.read_json_object(hf_dir / "config.json"), lm_head_fp8=lm_head_fp8)
    except UnsupportedModelError as e:
        raise UnsupportedModelError(e if str(e).startswith(str(hf_dir)) else f"{hf_dir}: {e}") from None
    src = _Source(hf_dir)
    quantize_io.check_spec(hf_dir, spec, src.weight_map)
    first = SOURCE_DTYPES[src.dtype("model.embed_tokens.weight")]

    def metadata(head_mode: str) -> dict:
        meta = _metadata(hf_dir, spec, head_mode, first)
        quantize_io.check_tokenizer(hf_dir, meta, spec)
        return meta

    return spec, src, metadata


def quantize(
    hf_dir: str | Path, out: str | Path, lm_head: str = "fp8", progress: bool = True, log=None, force: bool = False
) -> dict:
    """Quantize `hf_dir` (an HF directory or a .gguf file) into `out`. lm_head: 'fp8' (default) or
    'bf16'. force: overwrite an existing `out`. Returns a summary dict (per-matrix relative errors,
    bytes, checksum).

    The output path is checked before any work; temporaries of earlier runs to the same output
    that were killed are removed; on any error or catchable signal (InterruptedBySignal) the
    temporary file is removed and `out` is untouched."""
    log = log or (lambda s: print(s, file=sys.stderr))
    if lm_head not in ("fp8", "bf16"):
        raise ValueError(f"lm_head must be fp8 or bf16, got {lm_head!r}")
    source = Path(hf_dir) if str(hf_dir).lower().endswith(".gguf") else resolve_hf_dir(hf_dir)
    out = quantize_io.check_output_path(out, source, force)
    quantize_io.sweep_stale_temps(out, log)
    with quantize_io.raise_on_signals():
        try:
            summary = _quantize(source, out, lm_head, progress, log)
        except BaseException as e:
            temp_path(out).unlink(missing_ok=True)  # even if the signal came before the writer's `with`
            # A signal that lands inside a library's `try: acquire ... finally: release` surfaces as the
            # error of that cleanup ("release unlocked lock"): the signal is what ended the run.
            sig = quantize_io.signal_behind(e)
            if sig is not None and sig is not e:
                raise sig from None
            raise
    _print_error_table(ModelSpec.from_dict(summary["spec"]), summary["errors"], log)  # the file is in place
    return summary


def _quantize(source: Path, out: Path, lm_head: str, progress: bool, log) -> dict:
    spec, src, metadata = open_source(source, lm_head_fp8=(lm_head == "fp8"))
    head_mode = "tied" if (lm_head == "bf16" and spec.tie_word_embeddings) else lm_head
    head_src = "model.embed_tokens.weight" if spec.tie_word_embeddings else "lm_head.weight"
    tensors = expected_tensors(spec, head_mode)
    stats = _ErrStats()
    d, f = spec.hidden_size, spec.intermediate_size

    from tqdm import tqdm

    bar = tqdm(
        total=sum(t.nbytes for t in tensors), unit="B", unit_scale=True, desc="quantize", disable=not progress, file=sys.stderr
    )

    def write(w: FileWriter, name: str, a: np.ndarray) -> None:
        w.write(name, a)
        bar.update(a.nbytes)

    def write_bf16(w: FileWriter, name: str, hf_name: str, shape: tuple[int, ...]) -> None:
        for block in src.rows(hf_name, shape):
            write(w, name, block.astype(ml_dtypes.bfloat16))

    def quantize_block(block: np.ndarray):
        q, s = quantize_rows(block)
        return q, s, _ErrStats.sums(block, q, s)

    def write_fp8(w: FileWriter, name: str, parts: list[tuple[str, tuple[int, int]]], key: str) -> None:
        """Row blocks are quantized by a thread pool, at most 2 x threads in flight, written in order."""
        scales, pending = [], collections.deque()

        def drain_one():
            q, s, sums = pending.popleft().result()
            stats.add(key, sums)
            write(w, name, q)
            scales.append(s)

        for hf_name, shape in parts:
            for block in src.rows(hf_name, shape):
                pending.append(pool.submit(quantize_block, block))
                if len(pending) >= 2 * threads:
                    drain_one()
        while pending:
            drain_one()
        write(w, name + ".scale", np.concatenate(scales))

    threads = max(1, min(MAX_THREADS, os.cpu_count() or 1))
    pool = ThreadPoolExecutor(threads)
    try:
        with FileWriter(out, tensors, metadata(head_mode)) as w:
            write_bf16(w, "embed", "model.embed_tokens.weight", (spec.vocab_size, d))
            for i in range(spec.num_layers):
                p, h = f"layers.{i}.", f"model.layers.{i}."
                a = h + "self_attn."
                write(w, p + "attn_norm", src.vector(h + "input_layernorm.weight", d).astype(ml_dtypes.bfloat16))
                write_fp8(
                    w,
                    p + "wqkv",
                    [
                        (a + "q_proj.weight", (spec.q_dim, d)),
                        (a + "k_proj.weight", (spec.kv_dim, d)),
                        (a + "v_proj.weight", (spec.kv_dim, d)),
                    ],
                    f"{i}.wqkv",
                )
                if spec.attention_bias:
                    write(
                        w,
                        p + "bqkv",
                        np.concatenate(
                            [
                                src.vector(a + "q_proj.bias", spec.q_dim),
                                src.vector(a + "k_proj.bias", spec.kv_dim),
                                src.vector(a + "v_proj.bias", spec.kv_dim),
                            ]
                        ),
                    )
                if spec.qk_norm:
                    write(w, p + "q_norm", src.vector(a + "q_norm.weight", spec.head_dim).astype(ml_dtypes.bfloat16))
                    write(w, p + "k_norm", src.vector(a + "k_norm.weight", spec.head_dim).astype(ml_dtypes.bfloat16))
                write_fp8(w, p + "wo", [(a + "o_proj.weight", (d, spec.q_dim))], f"{i}.wo")
                write(w, p + "mlp_norm", src.vector(h + "post_attention_layernorm.weight", d).astype(ml_dtypes.bfloat16))
                write_fp8(w, p + "w13", [(h + "mlp.gate_proj.weight", (f, d)), (h + "mlp.up_proj.weight", (f, d))], f"{i}.w13")
                write_fp8(w, p + "w2", [(h + "mlp.down_proj.weight", (d, f))], f"{i}.w2")
            write(w, "final_norm", src.vector("model.norm.weight", d).astype(ml_dtypes.bfloat16))
            if head_mode == "fp8":
                write_fp8(w, "lm_head", [(head_src, (spec.vocab_size, d))], "lm_head")
            elif head_mode == "bf16":
                write_bf16(w, "lm_head", head_src, (spec.vocab_size, d))
    finally:
        bar.close()
        pool.shutdown(cancel_futures=True)

    summary = dict(
        path=str(out),
        bytes=Path(out).stat().st_size,
        spec=spec.to_dict(),
        lm_head=head_mode,
        source_dtypes=sorted(src.dtypes),
        errors={k: stats.rel(k) for k in stats.err},
    )
    return summary


def _print_error_table(spec: ModelSpec, errors: dict[str, float], log) -> None:
    """One row per layer: relative quantization error ||W - W'|| / ||W|| of each matrix."""
    log("relative quantization error ||W - Wq|| / ||W||")
    log(f"{'layer':>6}  {'wqkv':>8}  {'wo':>8}  {'w13':>8}  {'w2':>8}")
    for i in range(spec.num_layers):
        log(f"{i:>6}  " + "  ".join(f"{errors[f'{i}.{m}']:8.5f}" for m in ("wqkv", "wo", "w13", "w2")))
    if "lm_head" in errors:
        log(f"{'lm_head':>6}  {errors['lm_head']:8.5f}")
    worst = max(errors.values())
    log(f"worst matrix: {worst:.5f}")
