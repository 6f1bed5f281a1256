"""The .atomflow file (docs/FORMAT.md): a safetensors container holding FP8 weights, their
scales, bf16 embedding and norms, and everything needed to run the model (spec, tokenizer,
chat template, generation config) in its metadata.

safetensors' own writers take whole tensors in memory; ours streams them in row chunks so a
quantize never holds more than one tensor, hashes the data as it goes, and renames the file
into place only when complete.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np

from atomflow.errors import FormatError
from atomflow.model import filecheck
from atomflow.model.filecheck import encode_header  # noqa: F401 - the writer's header form, for tools and tests
from atomflow.model.spec import QUANT_GROUP, ModelSpec, scale_groups

FORMAT_NAME = "atomflow"
FORMAT_VERSION = "2"  # written; 2 = tail FP8 groups, QKV bias, q/k norms, arch fields in the spec
READABLE_VERSIONS = ("1", "2")  # a version-1 file is a version-2 file of a Llama without those
MAX_HEADER_BYTES = 100_000_000  # safetensors' own limit
_CHECKSUM_PLACEHOLDER = "sha256:" + "0" * 64

DTYPES: dict[str, np.dtype] = {
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F32": np.dtype(np.float32),
}


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str  # safetensors dtype string
    shape: tuple[int, ...]
    offset: int = 0  # absolute byte offset in the file (reader); 0 while planning

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * DTYPES[self.dtype].itemsize


def expected_tensors(spec: ModelSpec, lm_head: str) -> list[TensorInfo]:
    """The tensor table of a file for `spec`, in file order. lm_head: 'fp8' | 'bf16' | 'tied'."""
    d, f = spec.hidden_size, spec.intermediate_size

    def fp8(name: str, n: int, k: int) -> list[TensorInfo]:
        return [TensorInfo(name, "F8_E4M3", (n, k)), TensorInfo(name + ".scale", "F32", (n, scale_groups(k)))]

    out = [TensorInfo("embed", "BF16", (spec.vocab_size, d))]
    for i in range(spec.num_layers):
        p = f"layers.{i}."
        out.append(TensorInfo(p + "attn_norm", "BF16", (d,)))
        out += fp8(p + "wqkv", spec.qkv_dim, d)
        if spec.attention_bias:
            out.append(TensorInfo(p + "bqkv", "F32", (spec.qkv_dim,)))
        if spec.qk_norm:
            out += [TensorInfo(p + "q_norm", "BF16", (spec.head_dim,)), TensorInfo(p + "k_norm", "BF16", (spec.head_dim,))]
        out += fp8(p + "wo", d, spec.q_dim)
        out.append(TensorInfo(p + "mlp_norm", "BF16", (d,)))
        out += fp8(p + "w13", 2 * f, d)
        out += fp8(p + "w2", d, f)
    out.append(TensorInfo("final_norm", "BF16", (d,)))
    if lm_head == "fp8":
        out += fp8("lm_head", spec.vocab_size, d)
    elif lm_head == "bf16":
        out.append(TensorInfo("lm_head", "BF16", (spec.vocab_size, d)))
    elif lm_head != "tied":
        raise ValueError(f"lm_head must be fp8, bf16 or tied, got {lm_head!r}")
    return out


def dequantize_rows(q: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """fp8 [n, k], fp32 scales [n, ceil(k / 128)] -> fp32 [n, k]: w[n, c] = fp8[n, c] * scale[n, c // 128]
    (the last group covers the k % 128 columns left over, when there are any)."""
    n, k = q.shape
    return q.astype(np.float32) * np.repeat(scale, QUANT_GROUP, axis=1)[:, :k]


# ---------------------------------------------------------------------------------------
def temp_path(path: Path, pid: int | None = None) -> Path:
    """Where the writer builds `path` before renaming it into place: PATH.tmp-<pid>."""
    return path.with_name(f"{path.name}.tmp-{os.getpid() if pid is None else pid}")


class FileWriter:
    """Streams tensors, in table order, into `path` via a temporary file.

    with FileWriter(path, tensors, metadata) as w:
        w.write("embed", rows)   # any number of row chunks per tensor, in order
    On an exception the temporary file is removed and `path` is untouched."""

    def __init__(self, path: str | Path, tensors: list[TensorInfo], metadata: dict[str, str]):
        self.path = Path(path)
        self.tensors = tensors
        self.metadata = {k: str(v) for k, v in metadata.items()}
        self.metadata["checksum"] = _CHECKSUM_PLACEHOLDER
        self.metadata[filecheck.HEADER_CHECKSUM] = _CHECKSUM_PLACEHOLDER  # filled in by encode_header
        self.tmp = temp_path(self.path)
        self._index = 0  # tensor being written
        self._written = 0  # bytes of it written so far
        self._hash = hashlib.sha256()
        header = self._header()
        self._fh = open(self.tmp, "wb")
        self._fh.write(struct.pack("<Q", len(header)) + header)

    def _header(self) -> bytes:
        table: dict = {"__metadata__": self.metadata}
        pos = 0
        for t in self.tensors:
            table[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [pos, pos + t.nbytes]}
            pos += t.nbytes
        return encode_header(table)  # data region 8-byte aligned; header_checksum over the rest of the header

    def write(self, name: str, array: np.ndarray) -> None:
        if self._index >= len(self.tensors):
            raise ValueError(f"write({name!r}): every tensor is already written")
        t = self.tensors[self._index]
        if name != t.name:
            raise ValueError(f"write({name!r}): expected tensor {t.name!r} next")
        if array.dtype != DTYPES[t.dtype]:
            raise ValueError(f"write({name!r}): dtype {array.dtype}, table says {t.dtype}")
        buf = np.ascontiguousarray(array).view(np.uint8).reshape(-1)
        if self._written + buf.nbytes > t.nbytes:
            raise ValueError(f"write({name!r}): more bytes than its shape {t.shape} holds")
        self._fh.write(buf.data)
        self._hash.update(buf.data)
        self._written += buf.nbytes
        if self._written == t.nbytes:
            self._index, self._written = self._index + 1, 0

    def finish(self) -> str:
        """Checks every byte was written, fills in the checksum, renames into place."""
        if self._index != len(self.tensors):
            raise ValueError(f"file incomplete: tensor {self.tensors[self._index].name!r} not fully written")
        checksum = "sha256:" + self._hash.hexdigest()
        self.metadata["checksum"] = checksum
        header = self._header()
        self._fh.seek(8)
        self._fh.write(header)  # same length: the checksum has a fixed width
        self._fh.flush()
        os.fsync(self._fh.fileno())
        self._fh.close()
        os.replace(self.tmp, self.path)
        return checksum

    def abort(self) -> None:
        if not self._fh.closed:
            self._fh.close()
        self.tmp.unlink(missing_ok=True)

    def __enter__(self) -> FileWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()
            return
        try:
            self.finish()
        except BaseException:
            self.abort()
            raise


# ---------------------------------------------------------------------------------------
class AtomflowFile:
    """A checked, memory-mapped .atomflow file. Raises FormatError on anything wrong with it."""

    def __init__(self, path: str | Path, verify: bool = False):
        if not str(path).strip():
            raise FileNotFoundError("no model file given (the path is empty)")
        self.path = Path(path)
        if self.path.is_dir():
            raise FormatError(f"{self.path}: is a directory, not a model file")
        if not self.path.is_file():
            raise FileNotFoundError(f"no such model file: {self.path}")
        with open(self.path, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            if size < 8:
                raise FormatError(f"{self.path}: not an atomflow file ({size} bytes, too short for a header)")
            (n,) = struct.unpack("<Q", fh.read(8))
            if n < 2 or n > MAX_HEADER_BYTES or 8 + n > size:
                raise FormatError(f"{self.path}: not an atomflow file (header length {n} does not fit a {size}-byte file)")
            raw = fh.read(n)
            if len(raw) != n:
                raise FormatError(f"{self.path}: the file changed while it was read")
            header, meta = filecheck.parse_header(self.path, raw)
            self._mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        self.file_size = size
        self.data_offset = 8 + n
        if meta.get("format_version") not in READABLE_VERSIONS:
            raise FormatError(
                f"{self.path}: format version {meta.get('format_version')!r} is not supported "
                f"(this atomflow reads versions {', '.join(READABLE_VERSIONS)}); re-quantize the model"
            )
        self.header_checked = filecheck.check_header_checksum(self.path, raw, meta)
        self.raw_metadata: dict[str, str] = meta
        self.spec = filecheck.spec_from_metadata(self.path, meta)
        self.quantization = filecheck.quantization_from_metadata(self.path, meta, self.spec)
        self.documents = filecheck.check_documents(self.path, meta, self.spec)
        filecheck.check_checksum_field(self.path, meta)
        rows = filecheck.parse_table(self.path, header, {k: v.itemsize for k, v in DTYPES.items()})
        self.tensors = {name: TensorInfo(name, dtype, shape, self.data_offset + b) for name, dtype, shape, b, _ in rows}
        filecheck.check_quantization_against_tensors(
            self.path, self.quantization, {t.name: (t.dtype, t.shape) for t in self.tensors.values()}
        )
        self._check_table()
        filecheck.check_layout(self.path, rows, self.file_size - self.data_offset)
        self._check_order()
        self._tokenizer = None
        if verify:
            self.verify()

    def _check_table(self) -> None:
        """The tensors the spec implies, each with its dtype and shape."""
        if self.spec.num_layers > len(self.tensors):  # before building a table as long as the spec claims
            raise FormatError(
                f"{self.path}: tensor table does not match the model spec ({self.spec.num_layers} "
                f"layers, {len(self.tensors)} tensors)"
            )
        order = expected_tensors(self.spec, self.quantization.get("lm_head", "fp8"))
        want = {t.name: t for t in order}
        missing, extra = sorted(set(want) - set(self.tensors)), sorted(set(self.tensors) - set(want))
        if missing or extra:
            raise FormatError(
                f"{self.path}: tensor table does not match the model spec "
                f"(missing: {missing[:4] or 'none'}, unexpected: {extra[:4] or 'none'})"
            )
        for name, w in want.items():
            t = self.tensors[name]
            if (t.dtype, t.shape) != (w.dtype, w.shape):
                raise FormatError(
                    f"{self.path}: tensor {name!r} is {t.dtype} {list(t.shape)}, the spec needs {w.dtype} {list(w.shape)}"
                )

    def _check_order(self) -> None:
        """Stored in the format's order (the table order of docs/FORMAT.md)."""
        order = expected_tensors(self.spec, self.quantization["lm_head"])
        stored = sorted(self.tensors, key=lambda k: self.tensors[k].offset)
        for i, (got, w) in enumerate(zip(stored, order)):
            if got != w.name:
                raise FormatError(
                    f"{self.path}: tensor {got!r} is stored at position {i} of the data region, where the format puts {w.name!r}"
                )

    def verify(self) -> None:
        """--verify: the data checksum, the values (no NaN codes, finite norms, positive finite
        scales) and the tokenizer and chat template (built and rendered once)."""
        self.verify_checksum()
        self.verify_values()
        self.tokenizer()

    # -- access ------------------------------------------------------------------------------
    def metadata_json(self, key: str, default=None):
        """A metadata document, parsed (the reader has checked generation_config, tokenizer_config
        and source)."""
        if key in self.documents:
            return self.documents[key] if self.raw_metadata.get(key) else default
        raw = self.raw_metadata.get(key)
        return default if raw in (None, "") else filecheck.parse_json(raw, f"metadata {key!r}", self.path)

    def tokenizer(self):
        """The file's Tokenizer, built once and checked: tokenizer.json parses, its ids fit the
        vocab, the chat template compiles and renders one user turn."""
        if self._tokenizer is None:
            from atomflow.model.tokenizer import checked_tokenizer

            self._tokenizer = checked_tokenizer(
                self.path,
                self.raw_metadata["tokenizer"],
                self.metadata_json("tokenizer_config", {}),
                self.raw_metadata.get("chat_template", ""),
                self.metadata_json("generation_config", {}),
                self.spec.vocab_size,
            )
        return self._tokenizer

    @property
    def checksum(self) -> str:
        return self.raw_metadata.get("checksum", "")

    def verify_checksum(self) -> None:
        h = hashlib.sha256()
        view = memoryview(self._mm)
        step = 64 << 20
        for off in range(self.data_offset, self.file_size, step):
            h.update(view[off : min(off + step, self.file_size)])
        view.release()
        got = "sha256:" + h.hexdigest()
        if got != self.checksum:  # the reader has checked its form
            raise FormatError(
                f"{self.path}: checksum mismatch: the data is corrupt "
                f"(header says {self.checksum[:23]}..., data hashes to {got[:23]}...)"
            )

    def verify_values(self) -> None:
        """Every tensor's values, in chunks: what the quantizer never writes and the engine
        cannot compute with (filecheck.bad_values)."""
        step = 16 << 20
        for t in self.tensors.values():
            flat = self.array(t.name).reshape(-1)
            per = max(1, step // DTYPES[t.dtype].itemsize)
            for a in range(0, flat.size, per):
                why = filecheck.bad_values(t.dtype, t.name, flat[a : a + per])
                if why:
                    raise FormatError(f"{self.path}: tensor {t.name!r} holds {why} (the file's weights would produce NaN/Inf)")

    def array(self, name: str) -> np.ndarray:
        """Zero-copy read-only view of a tensor (ml_dtypes types for FP8 and bf16)."""
        t = self.tensors[name]
        return np.frombuffer(self._mm, dtype=DTYPES[t.dtype], count=int(np.prod(t.shape)), offset=t.offset).reshape(t.shape)

    def weight_f32(self, name: str) -> np.ndarray:
        """A weight as float32, dequantized when FP8: w[n, k] = fp8[n, k] * scale[n, k // 128]."""
        a = self.array(name)
        if self.tensors[name].dtype != "F8_E4M3":
            return a.astype(np.float32)
        return dequantize_rows(a, self.array(name + ".scale"))

    def lm_head_f32(self) -> np.ndarray:
        return self.weight_f32("lm_head" if "lm_head" in self.tensors else "embed")

    def tensor_table(self) -> list[dict]:
        """For the CUDA core: name, dtype, shape, absolute offset, nbytes, in file order."""
        return [
            dict(name=t.name, dtype=t.dtype, shape=list(t.shape), offset=t.offset, nbytes=t.nbytes)
            for t in sorted(self.tensors.values(), key=lambda t: t.offset)
        ]

    @property
    def weight_bytes(self) -> int:
        """Bytes a decode step must read once: every tensor except the embedding table (only one
        row of it is read) — unless the embedding doubles as the lm_head."""
        total = sum(t.nbytes for t in self.tensors.values())
        return total - (0 if "lm_head" not in self.tensors else self.tensors["embed"].nbytes)

    def close(self) -> None:
        try:
            self._mm.close()
        except BufferError:  # arrays still view the map; it closes when they are gone
            pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
