"""The .atomflow reader's checks (docs/FORMAT.md, "What the reader refuses").

Every field of a file is checked here, at the boundary, before anything is allocated or computed
from it: the header's JSON types, the tensor table against the file size (ordered, contiguous, no
trailing bytes), the spec's values (typed, bounded, consistent), the quantization fields against
the tensors, the metadata documents, the header checksum. Each check raises FormatError with one
line naming the file and the problem.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re

import numpy as np

from atomflow.errors import FormatError, UnsupportedModelError
from atomflow.model.spec import QUANT_GROUP, V1_ABSENT_FIELDS, ModelSpec

HEADER_CHECKSUM = "header_checksum"
_HEADER_CHECKSUM_KEY = b'"header_checksum":"sha256:'
_SHA256 = re.compile(r"sha256:[0-9a-f]{64}")
PLACEHOLDER = "sha256:" + "0" * 64
SCHEMES = {"fp8_e4m3fn_w8a16": "F8_E4M3"}  # scheme -> dtype of its weight matrices
SCALE_DTYPES = ("F32",)
LM_HEAD_MODES = ("fp8", "bf16", "tied")
MAX_DIM = 1 << 32  # any one dimension of a tensor
FLOAT32_MAX = float(np.finfo(np.float32).max)
MAX_SCALE = FLOAT32_MAX / 448  # absmax / 448 of any float32 weight
# Spec integers are int32 in the C++ mirror (include/atomflow/spec.h); these bound them further
# so that nothing sized from a spec can be absurd before the tensor table is compared with it.
SPEC_LIMITS = {
    "num_layers": 4096,
    "vocab_size": 1 << 22,
    "hidden_size": 1 << 17,
    "intermediate_size": 1 << 19,
    "num_heads": 1024,
    "num_kv_heads": 1024,
    "max_position_embeddings": 1 << 24,
    "rope_original_max_position_embeddings": 1 << 24,
}


def _fail(path, msg: str) -> FormatError:
    return FormatError(f"{path}: {msg}")


def _short(v, n: int = 40) -> str:
    s = repr(v)
    return s if len(s) <= n else s[:n] + "..."


# -- header JSON ---------------------------------------------------------------------------------
def _no_duplicates(pairs):
    d = {}
    for k, v in pairs:
        if k in d:
            raise ValueError(f"duplicate key {k!r}")
        d[k] = v
    return d


def _no_constants(name):
    raise ValueError(f"{name} is not JSON")


def parse_json(text: str | bytes, what: str, path):
    """Strict JSON (no duplicate keys, no NaN/Infinity, bounded nesting) or a FormatError."""
    try:
        if isinstance(text, bytes):
            text = text.decode("utf-8")
        return json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_no_constants)
    except UnicodeDecodeError:
        raise _fail(path, f"{what} is not UTF-8") from None
    except RecursionError:
        raise _fail(path, f"{what} is nested too deeply") from None
    except ValueError as e:
        raise _fail(path, f"{what} is not valid JSON ({str(e).splitlines()[0][:80]})") from None


def parse_header(path, raw: bytes) -> tuple[dict, dict[str, str]]:
    """(tensor entries, metadata) of the raw header bytes."""
    if (8 + len(raw)) % 8:
        raise _fail(path, f"not an atomflow file (header length {len(raw)} is not padded to 8 bytes)")
    try:
        header = parse_json(raw, "header", path)
    except FormatError:
        raise _fail(path, "not an atomflow file (header is not JSON)") from None
    if not isinstance(header, dict):
        raise _fail(path, f"not an atomflow file (header is a JSON {type(header).__name__}, not an object)")
    meta = header.pop("__metadata__", None)
    if not isinstance(meta, dict) or meta.get("format") != "atomflow":
        raise _fail(path, 'not an atomflow file (no "format": "atomflow" in its metadata)')
    for k, v in meta.items():
        if not isinstance(v, str):
            raise _fail(path, f"metadata {k!r} is a {type(v).__name__}; safetensors metadata values are strings")
    return header, meta


# -- header checksum -----------------------------------------------------------------------------
def header_digest(raw: bytes) -> str | None:
    """sha256 of the header bytes with the 64 hex digits of header_checksum zeroed; None when the
    header has no header_checksum in the writer's form (exactly one `"header_checksum":"sha256:`)."""
    at = raw.find(_HEADER_CHECKSUM_KEY)
    if at < 0 or raw.find(_HEADER_CHECKSUM_KEY, at + 1) >= 0:
        return None
    start = at + len(_HEADER_CHECKSUM_KEY)
    return "sha256:" + hashlib.sha256(raw[:start] + b"0" * 64 + raw[start + 64 :]).hexdigest()


def encode_header(table: dict) -> bytes:
    """The header bytes the writer puts after the 8-byte length: compact JSON, padded with spaces
    so the data region starts 8-byte aligned, header_checksum (if the metadata has the key)
    filled in."""
    meta = table.get("__metadata__")
    sealed = isinstance(meta, dict) and HEADER_CHECKSUM in meta
    if sealed:
        table = dict(table, __metadata__=dict(meta, **{HEADER_CHECKSUM: PLACEHOLDER}))
    raw = json.dumps(table, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % 8)
    if sealed:
        digest = header_digest(raw)
        if digest is None:
            raise ValueError("header_checksum: the key appears more than once in the header")
        start = raw.find(_HEADER_CHECKSUM_KEY) + len(_HEADER_CHECKSUM_KEY)
        raw = raw[:start] + digest[7:].encode() + raw[start + 64 :]
    return raw


def check_header_checksum(path, raw: bytes, meta: dict[str, str]) -> bool:
    """True when checked; False for a file written before header checksums existed."""
    if HEADER_CHECKSUM not in meta:
        return False
    stated = meta[HEADER_CHECKSUM]
    got = header_digest(raw)
    if not _SHA256.fullmatch(stated):
        raise _fail(path, f"malformed header_checksum {_short(stated, 24)}")
    if got is None:
        raise _fail(path, "header checksum mismatch: the header is not as the writer wrote it (rewritten by another tool?)")
    if got != stated:
        raise _fail(
            path,
            f"header checksum mismatch: the header (spec, tokenizer, tensor table) was changed or is "
            f"corrupt (it says {stated[:23]}..., the header hashes to {got[:23]}...)",
        )
    return True


# -- tensor table --------------------------------------------------------------------------------
def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def parse_table(path, header: dict, itemsizes: dict[str, int]) -> list[tuple]:
    """[(name, dtype, shape, begin, end)]: each entry's types checked, its byte count dtype x shape."""
    rows = []
    for name, e in header.items():
        if not isinstance(e, dict) or set(e) != {"dtype", "shape", "data_offsets"}:
            raise _fail(path, f"malformed tensor entry {name!r} (needs exactly dtype, shape, data_offsets)")
        dtype, shape, offs = e["dtype"], e["shape"], e["data_offsets"]
        if not isinstance(dtype, str) or dtype not in itemsizes:
            raise _fail(path, f"tensor {name!r} has unsupported dtype {_short(dtype)}")
        if not isinstance(shape, list) or not all(_is_int(s) and 0 <= s <= MAX_DIM for s in shape) or len(shape) > 8:
            raise _fail(path, f"tensor {name!r} has a malformed shape {_short(shape)}")
        if not isinstance(offs, list) or len(offs) != 2 or not all(_is_int(o) and o >= 0 for o in offs):
            raise _fail(path, f"tensor {name!r} has malformed data_offsets {_short(offs)}")
        b, end = offs
        nbytes = math.prod(shape) * itemsizes[dtype]
        if end - b != nbytes:
            raise _fail(path, f"tensor {name!r}: offsets {b}..{end} do not match shape {shape} {dtype} ({nbytes} bytes)")
        rows.append((name, dtype, tuple(shape), b, end))
    return rows


def check_layout(path, rows: list[tuple], data_len: int) -> None:
    """The entries tile the data region exactly: in range, no overlap, no gap, no trailing bytes
    (safetensors' own rules)."""
    pos, prev = 0, None
    for name, _, _, b, end in sorted(rows, key=lambda r: (r[3], r[4])):
        if end > data_len:
            raise _fail(
                path, f"truncated: tensor {name!r} ends at byte {end} of the data region, which holds only {data_len} bytes"
            )
        if b != pos:
            what = f"overlaps {prev!r}" if b < pos else f"leaves a gap of {b - pos} bytes after {prev or 'the header'!r}"
            raise _fail(path, f"tensor {name!r} at data bytes {b}..{end} {what}")
        pos, prev = end, name
    if pos != data_len:
        raise _fail(path, f"{data_len - pos} trailing bytes after the last tensor")


# -- spec and quantization -------------------------------------------------------------------------
def _check_field(path, name: str, kind: str, v) -> None:
    ok = {
        "int": lambda: _is_int(v) and 0 <= v <= SPEC_LIMITS.get(name, 2**31 - 1),
        "float": lambda: (_is_int(v) or isinstance(v, float)) and math.isfinite(v) and abs(v) <= FLOAT32_MAX,
        "bool": lambda: isinstance(v, bool),
        "str": lambda: isinstance(v, str),
    }.get(kind, lambda: True)()
    if not ok:
        limit = f" in [0, {SPEC_LIMITS.get(name, 2**31 - 1)}]" if kind == "int" else ""
        raise _fail(path, f"bad model spec: {name} must be a{'n' if kind == 'int' else ''} {kind}{limit}, got {_short(v)}")


def spec_from_metadata(path, meta: dict[str, str]) -> ModelSpec:
    """ModelSpec from the `spec` document: every field typed by the dataclass's annotation and
    bounded, then ModelSpec's own consistency checks, then a finite RoPE table."""
    if "spec" not in meta:
        raise _fail(path, "bad spec/quantization metadata (no 'spec')")
    d = parse_json(meta["spec"], "metadata 'spec'", path)
    if not isinstance(d, dict):
        raise _fail(path, f"bad model spec: a JSON {type(d).__name__}, not an object")
    fields = {f.name: f for f in dataclasses.fields(ModelSpec)}
    unknown = sorted(set(d) - set(fields))
    if unknown:
        raise _fail(path, f"bad model spec: unknown field {unknown[0]!r}")
    for name, f in fields.items():
        if name not in d:
            # a field with a default may be absent only where the file's version predates it
            if meta.get("format_version") != "1" or name not in V1_ABSENT_FIELDS:
                raise _fail(path, f"bad spec/quantization metadata (model spec is missing {name!r})")
            continue
        _check_field(path, name, f.type if isinstance(f.type, str) else getattr(f.type, "__name__", ""), d[name])
    try:
        spec = ModelSpec.from_dict(d)
    except (UnsupportedModelError, ValueError, TypeError) as e:
        raise _fail(path, f"bad model spec: {str(e).splitlines()[0]}") from None
    with np.errstate(all="ignore"):
        inv = spec.rope_inv_freq()
    if not (np.isfinite(inv).all() and (inv > 0).all()):
        raise _fail(path, "bad model spec: its rope parameters give non-finite or zero frequencies")
    return spec


def quantization_from_metadata(path, meta: dict[str, str], spec: ModelSpec) -> dict:
    if "quantization" not in meta:
        raise _fail(path, "bad spec/quantization metadata (no 'quantization')")
    q = parse_json(meta["quantization"], "metadata 'quantization'", path)
    if not isinstance(q, dict):
        raise _fail(path, f"bad quantization metadata: a JSON {type(q).__name__}, not an object")
    for key, ok, want in (
        ("scheme", lambda v: isinstance(v, str), "a string"),
        ("group_size", lambda v: _is_int(v) and v > 0, "a positive integer"),
        ("scale_dtype", lambda v: isinstance(v, str), "a string"),
        ("lm_head", lambda v: v in LM_HEAD_MODES, " or ".join(LM_HEAD_MODES)),
    ):
        if key not in q or not ok(q[key]):
            raise _fail(path, f"quantization.{key} must be {want}, got {_short(q.get(key, 'nothing'))}")
    if "source_dtype" in q and not isinstance(q["source_dtype"], str):
        raise _fail(path, f"quantization.source_dtype must be a string, got {_short(q['source_dtype'])}")
    mode = q["lm_head"]
    if (mode == "fp8") != spec.lm_head_fp8 or (mode == "tied") != (spec.tie_word_embeddings and not spec.lm_head_fp8):
        raise _fail(
            path,
            f"quantization.lm_head {mode!r} disagrees with the spec (lm_head_fp8 {spec.lm_head_fp8}, "
            f"tie_word_embeddings {spec.tie_word_embeddings})",
        )
    return q


def check_quantization_against_tensors(path, q: dict, tensors: dict[str, tuple[str, tuple]]) -> None:
    """The fields name what the tensors hold: each FP8 weight's dtype (scheme), its scale's
    columns (group_size) and dtype (scale_dtype), the lm_head's storage. A disagreement is refused
    by field name; an agreeing but unsupported value is refused as unsupported."""
    head = tensors.get("lm_head")
    stored = "tied" if head is None else ("fp8" if head[0] != "BF16" else "bf16")
    if stored != q["lm_head"]:
        raise _fail(
            path,
            f"quantization.lm_head says {q['lm_head']}, but the file's lm_head is {'absent (tied)' if head is None else head[0]}",
        )
    for name in sorted(tensors):
        if not name.endswith(".scale") or name[:-6] not in tensors:
            continue
        (wd, ws), (sd, ss) = tensors[name[:-6]], tensors[name]
        if SCHEMES.get(q["scheme"], wd) != wd:
            raise _fail(
                path, f"quantization.scheme {q['scheme']!r} says {SCHEMES[q['scheme']]} weights, but {name[:-6]!r} is {wd}"
            )
        if sd != q["scale_dtype"]:
            raise _fail(path, f"quantization.scale_dtype says {q['scale_dtype']}, but {name!r} is {sd}")
        if len(ws) == 2 and len(ss) == 2 and ss[1] != -(-ws[1] // q["group_size"]):  # ceil: a tail group
            raise _fail(
                path,
                f"quantization.group_size says {q['group_size']}, but {name!r} {list(ss)} "
                f"holds {ss[1]} groups for the {ws[1]} columns of {name[:-6]!r} {list(ws)}",
            )
        break  # one weight shows what the fields mean; _check_table holds every other to the same shapes
    if q["scheme"] not in SCHEMES:
        raise _fail(path, f"quantization scheme {q['scheme']!r} is not supported (this atomflow reads {', '.join(SCHEMES)})")
    if q["group_size"] != QUANT_GROUP:
        raise _fail(path, f"quantization.group_size {q['group_size']} is not supported (this atomflow reads {QUANT_GROUP})")
    if q["scale_dtype"] not in SCALE_DTYPES:
        raise _fail(
            path,
            f"quantization.scale_dtype {q['scale_dtype']!r} is not supported (this atomflow reads {', '.join(SCALE_DTYPES)})",
        )


# -- the metadata documents ------------------------------------------------------------------------
def _opt(kind):
    return lambda v: v is None or kind(v)


def _token_id(vocab: int):
    return lambda v: _is_int(v) and 0 <= v < vocab


def _number(lo: float, hi: float, lo_open: bool = False):
    return lambda v: (_is_int(v) or isinstance(v, float)) and math.isfinite(v) and (v > lo if lo_open else v >= lo) and v <= hi


def check_documents(path, meta: dict[str, str], spec: ModelSpec) -> dict[str, dict]:
    """generation_config, tokenizer_config and source: JSON objects with typed fields; EOS/BOS ids
    in the vocab; default sampling values the sampler accepts. Returns them parsed."""
    vocab = spec.vocab_size
    shapes = {
        "generation_config": {
            "bos_token_id": _opt(_token_id(vocab)),
            "eos_token_ids": lambda v: isinstance(v, list) and all(map(_token_id(vocab), v)),
            "temperature": _opt(_number(0, 1e6)),
            "top_p": _opt(_number(0, 1, lo_open=True)),
            "top_k": _opt(lambda v: _is_int(v) and 0 <= v < 2**31),
        },
        "tokenizer_config": {
            "bos_token": _opt(lambda v: isinstance(v, str)),
            "eos_token": _opt(lambda v: isinstance(v, str)),
            "add_bos_token": _opt(lambda v: isinstance(v, bool)),
            "chat_template_source": _opt(lambda v: isinstance(v, str)),
        },
        "source": {
            "repo_id": _opt(lambda v: isinstance(v, str)),
            "revision": _opt(lambda v: isinstance(v, str)),
            "path": _opt(lambda v: isinstance(v, str)),
        },
    }
    out = {}
    for doc, fields in shapes.items():
        raw = meta.get(doc, "")
        d = {} if raw == "" else parse_json(raw, f"metadata {doc!r}", path)
        if not isinstance(d, dict):
            raise _fail(path, f"metadata {doc!r} is a JSON {type(d).__name__}, not an object")
        for k, ok in fields.items():
            if k in d and not ok(d[k]):
                raise _fail(path, f"metadata {doc}.{k} is invalid: {_short(d[k])}")
        out[doc] = d
    if "tokenizer" not in meta:
        raise _fail(path, "no tokenizer in the metadata")
    return out


def check_checksum_field(path, meta: dict[str, str]) -> None:
    checksum = meta.get("checksum")
    if checksum is None or not _SHA256.fullmatch(checksum):
        raise _fail(path, f"malformed data checksum {_short(checksum, 24)} (want sha256:<64 hex digits>)")


# -- the data (with --verify) ----------------------------------------------------------------------
def bad_values(dtype: str, name: str, a: np.ndarray) -> str | None:
    """What is wrong with one chunk of a tensor's values, or None: NaN codes in FP8 weights,
    non-finite bf16 values, scales that are not finite and positive."""
    if dtype == "F8_E4M3":
        if ((a.view(np.uint8) & 0x7F) == 0x7F).any():
            return "an FP8 NaN code"
    elif dtype == "BF16":
        if ((a.view(np.uint16) & 0x7F80) == 0x7F80).any():
            return "a NaN or Inf value"
    elif dtype == "F32":
        if name.endswith(".scale") and not ((a > 0) & (a <= MAX_SCALE)).all():  # NaN fails both
            return f"a scale outside (0, {MAX_SCALE:.3g}]"
        if not np.isfinite(a).all():
            return "a NaN or Inf value"
    return None
