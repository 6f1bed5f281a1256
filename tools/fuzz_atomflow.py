"""Seeded mutation fuzz of the .atomflow reader: every variant of a valid file must end in one
clean error line (an AtomflowError), in bounded time and memory, never a traceback or an answer.

    python tools/fuzz_atomflow.py [--variants 1000] [--seed 0] [--workers 2] [--show 20]

Builds a one-layer tiny model (tools/make_tiny_model.py + the quantizer), derives variants from
it (truncations, appended bytes, bit flips, header-length edits, tensor-table and metadata
mutations re-signed with fresh checksums, NaN/Inf planted in the data), and runs each, in forked
workers with an address-space limit (1 GiB over their size at fork) and a timer per command
(10 s), through the two paths a user takes:
  info  `atomflow info --json --verify` (cli.cmd_info)
  run   `atomflow run --backend cpu` of a two-token generation (cli.cmd_run; no --verify)
Each run ends in one outcome:
  error      an AtomflowError with a one-line message (the CLI: one line, exit 1)
  generic    another ValueError / OSError / RuntimeError (one line, but not a statement about the file)
  traceback  any other exception (the CLI printed a Python traceback)
  accepted   no error: the damaged file was read (and, for run, generated from)
  timeout    past the time limit;  oom  MemoryError at the memory limit;  crash  the worker died
Variants of kind `values` (NaN/Inf planted in the data, checksums re-signed) and bit flips of the
data region may legitimately pass `run` (no --verify; only the weights used by the prompt are
touched): for them `accepted` is allowed in run mode, nothing else is.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import hashlib
import importlib.util
import io
import json
import os
import resource
import select
import signal
import struct
import sys
import tempfile
import time
from argparse import Namespace
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
MODES = ("info", "run")
TIME_LIMIT_S = 10.0  # per mode, in the child
MEMORY_LIMIT = 1 << 30  # address space the child may add to what it has at fork
_NAN_OK_KINDS = ("values", "bitflip-data")


# -- the base file -----------------------------------------------------------------------------
def build_base(workdir: Path) -> Path:
    """A one-layer tiny model, quantized: ~1.5 MB, with the tiny tokenizer and chat template."""
    spec = importlib.util.spec_from_file_location("make_tiny_model", ROOT / "tools" / "make_tiny_model.py")
    mod = sys.modules.get("make_tiny_model")
    if mod is None:
        mod = importlib.util.module_from_spec(spec)
        sys.modules["make_tiny_model"] = mod
        spec.loader.exec_module(mod)
    from atomflow.model.quantize import quantize

    hf = mod.make_model(workdir / "hf", preset="tiny", seed=7, num_layers=1, threads=1)
    out = workdir / "base.atomflow"
    quantize(hf, out, progress=False, log=lambda s: None)
    return out


@dataclass
class Parsed:
    raw: bytes
    n: int
    header: dict
    data: bytes


_parsed: dict[int, Parsed] = {}


def parse(raw: bytes) -> Parsed:
    """The base file's parts (cached: every variant starts from the same base; callers copy what they change)."""
    p = _parsed.get(id(raw))
    if p is None or p.raw is not raw:
        (n,) = struct.unpack("<Q", raw[:8])
        p = _parsed[id(raw)] = Parsed(raw, n, json.loads(raw[8 : 8 + n]), raw[8 + n :])
    return p


def pack(header: dict, data: bytes, resign: bool = True) -> bytes:
    """Serialize as the writer does; resign: fresh data checksum (and header checksum, where the
    reader has one), so only the structural checks can catch the mutation."""
    header = json.loads(json.dumps(header))
    meta = header.get("__metadata__")
    if resign and isinstance(meta, dict) and "checksum" in meta:
        meta["checksum"] = "sha256:" + hashlib.sha256(data).hexdigest()
    from atomflow.model import fileformat

    encode = getattr(fileformat, "encode_header", None)
    if encode is not None and resign:
        raw = encode(header)
    else:
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-(8 + len(raw)) % 8)
    return struct.pack("<Q", len(raw)) + raw + data


# -- mutations ---------------------------------------------------------------------------------
INT_BAD = [0, -1, 10**9, 2**31, 10**30, 1.5, "7", None, True, [], {}]
FLOAT_BAD = [0.0, -1.0, float("nan"), float("inf"), float("-inf"), 1e39, "1e-5", None, True, []]
TEMPLATES_BAD = [
    "{% if %}",
    "{{ raise_exception('bad conversation') }}",
    "{{ messages[5]['content'].x }}",
    "{{ 1 / 0 }}",
    "{% for m in messages %}{{ m.content.nope.x }}{% endfor %}",
    "{{ foo() }}",
    "{{ ''.__class__.__mro__ }}",
    "{% extends 'base' %}",
    "{% include 'x' %}",
    "{{ messages | tojson(indent=[]) }}",
    "{{ '' }}",
    "{% for m in messages %}{% endfor",
]


def _pick(rng, options: list, p=None):
    return options[int(rng.choice(len(options), p=p))]


def _tensor_names(h: dict) -> list[str]:
    return sorted((k for k in h if k != "__metadata__"), key=lambda k: h[k]["data_offsets"][0])


def _table_op(p: Parsed, rng) -> tuple[str, dict, bytes]:
    h = json.loads(json.dumps(p.header))
    data = p.data
    names = _tensor_names(h)
    i = int(rng.integers(len(names)))
    t = names[i]
    e = h[t]
    b, end = e["data_offsets"]
    op = _pick(
        rng,
        [
            "shift",
            "end",
            "overlap",
            "gap",
            "trailing",
            "swap",
            "dtype",
            "shape",
            "offsets",
            "entry",
            "keys",
            "remove",
            "add",
            "rename",
            "alias",
            "short",
        ],
    )
    if op == "shift":
        k = int(_pick(rng, [-64, -8, -1, 1, 8, 64]))
        e["data_offsets"] = [b + k, end + k]
    elif op == "end":
        e["data_offsets"] = [b, end + int(_pick(rng, [-8, -1, 1, 8]))]
    elif op == "overlap" and i > 0:
        prev = h[names[i - 1]]["data_offsets"]
        e["data_offsets"] = [prev[0], prev[0] + end - b]
    elif op == "gap":
        pad = int(_pick(rng, [1, 8, 128]))
        for n in names[i + 1 :]:
            h[n]["data_offsets"] = [x + pad for x in h[n]["data_offsets"]]
        data = data[:end] + bytes(pad) + data[end:]
    elif op == "trailing":
        data = data + bytes(int(_pick(rng, [1, 8, 4096])))
    elif op == "swap":
        j = int(rng.integers(len(names)))
        h[t]["data_offsets"], h[names[j]]["data_offsets"] = h[names[j]]["data_offsets"], h[t]["data_offsets"]
        op = f"swap-{t}-{names[j]}"
        if j == i:
            e["data_offsets"] = [end, b]
    elif op == "dtype":
        e["dtype"] = _pick(rng, ["F32", "BF16", "F8_E4M3", "F16", "I64", "F8", 7, None])
        if e["dtype"] == p.header[t]["dtype"]:
            e["dtype"] = "U8"
    elif op == "shape":
        s = list(e["shape"])
        how = _pick(rng, ["double", "swap", "append", "empty", "neg", "huge", "float", "str", "bool", "nested", "null", "zero"])
        e["shape"] = {
            "double": [s[0] * 2] + s[1:],
            "swap": s[::-1] if len(s) > 1 and s[0] != s[-1] else s + [2],
            "append": s + [1],
            "empty": [],
            "neg": [-s[0]] + s[1:],
            "huge": [2**62] + s[1:],
            "float": [float(s[0])] + s[1:],
            "str": [str(s[0])] + s[1:],
            "bool": [True] + s[1:],
            "nested": [s],
            "null": None,
            "zero": [0] + s[1:],
        }[how]
        op = f"shape-{how}"
    elif op == "offsets":
        how = _pick(rng, ["one", "three", "str", "none", "float", "neg", "reversed", "huge", "bool"])
        e["data_offsets"] = {
            "one": [b],
            "three": [b, end, end],
            "str": f"{b},{end}",
            "none": [b, None],
            "float": [float(b), float(end)],
            "neg": [-8, end - 8],
            "reversed": [end, b],
            "huge": [2**64, 2**64 + end - b],
            "bool": [False, True],
        }[how]
        op = f"offsets-{how}"
    elif op == "entry":
        h[t] = _pick(rng, [5, [], "x", None, {}])
    elif op == "keys":
        if rng.random() < 0.5:
            del e[_pick(rng, ["dtype", "shape", "data_offsets"])]
        else:
            e["extra"] = 1
    elif op == "remove":
        del h[t]
    elif op == "add":
        h["layers.9.wo"] = {"dtype": "F32", "shape": [2], "data_offsets": [len(data), len(data) + 8]}
        data = data + bytes(8)
    elif op == "rename":
        h[t + "x"] = h.pop(t)
    elif op == "alias":
        h["alias"] = dict(e)
    elif op == "short":  # a tensor shrunk, the data cut to match
        e["data_offsets"] = [b, end - 1] if end - b > 1 else [b, end + 1]
    else:
        op = "trailing"
        data = data + bytes(8)
    return f"table-{op}-{t}", h, data


def _meta_op(p: Parsed, rng) -> tuple[str, dict, bytes]:
    h = json.loads(json.dumps(p.header))
    m = h["__metadata__"]
    area = _pick(
        rng,
        [
            "spec",
            "spec",
            "spec",
            "quant",
            "tokenizer",
            "tokcfg",
            "template",
            "gen",
            "gen",
            "format",
            "types",
            "checksum",
            "source",
        ],
    )
    if area == "spec":
        spec = json.loads(m["spec"])
        how = _pick(rng, ["field", "field", "field", "field", "remove", "notjson", "list", "null", "layers"])
        if how == "field":
            k = str(_pick(rng, sorted(spec)))
            v = spec[k]
            if isinstance(v, bool):
                bad = [1, "true", None, 0]
            elif isinstance(v, int):
                bad = INT_BAD
            elif isinstance(v, float):
                bad = FLOAT_BAD
            else:
                bad = ["llama4", "", 3, None]
            spec[k] = bad[int(rng.integers(len(bad)))]
            if k == "lm_head_fp8" and spec[k] == 1:
                spec[k] = False  # contradicts the tensors
            m["spec"] = json.dumps(spec)
            return f"spec-{k}={spec[k]!r}", h, p.data
        if how == "layers":
            spec["num_layers"] = 10**9
            m["spec"] = json.dumps(spec)
        elif how == "remove":  # a field without a default (lm_head_fp8 defaults to its usual value: still valid)
            del spec[str(_pick(rng, sorted(k for k in spec if k != "lm_head_fp8")))]
            m["spec"] = json.dumps(spec)
        else:
            m["spec"] = {"notjson": "{num_layers: 1", "list": "[]", "null": "null"}[how]
        return f"spec-{how}", h, p.data
    if area == "quant":
        q = json.loads(m["quantization"])
        k = _pick(rng, ["scheme", "group_size", "scale_dtype", "lm_head", "source_dtype", "remove", "list"])
        vals = {
            "scheme": ["int8_w8a16", "", None, 5],
            "group_size": [64, 0, "128", 256, 128.5, None, -128],
            "scale_dtype": ["BF16", "F16", "", None],
            "lm_head": ["bf16", "tied", "x", None],
            "source_dtype": [5, None, []],
        }
        if k == "remove":
            del q[str(_pick(rng, ["scheme", "group_size", "scale_dtype", "lm_head"]))]
        elif k == "list":
            q = [q]
        else:
            q[k] = vals[k][int(rng.integers(len(vals[k])))]
        m["quantization"] = json.dumps(q)
        return f"quant-{k}", h, p.data
    if area == "tokenizer":
        tok = m["tokenizer"]
        how = _pick(rng, ["empty", "object", "notjson", "half", "model", "list", "vocab"])
        if how == "vocab":  # a tokenizer that knows more ids than the model has
            t = json.loads(tok)
            start = max(a["id"] for a in t["added_tokens"]) + 1
            t["added_tokens"] += [dict(t["added_tokens"][0], id=start + j, content=f"<extra{j}>") for j in range(4)]
            m["tokenizer"] = json.dumps(t)
        else:
            m["tokenizer"] = {
                "empty": "",
                "object": "{}",
                "notjson": "tokenizer",
                "half": tok[: len(tok) // 2],
                "model": '{"model": 5}',
                "list": "[]",
            }[how]
        return f"tokenizer-{how}", h, p.data
    if area == "tokcfg":
        c = json.loads(m["tokenizer_config"])
        how = _pick(rng, ["list", "int", "notjson", "bos", "eos", "src", "addbos"])
        if how in ("list", "int", "notjson"):
            m["tokenizer_config"] = {"list": "[]", "int": "5", "notjson": "{bos"}[how]
        else:
            c[{"bos": "bos_token", "eos": "eos_token", "src": "chat_template_source", "addbos": "add_bos_token"}[how]] = _pick(
                rng, [5, ["x"], {"a": 1}]
            )
            m["tokenizer_config"] = json.dumps(c)
        return f"tokcfg-{how}", h, p.data
    if area == "template":
        i = int(rng.integers(len(TEMPLATES_BAD)))
        m["chat_template"] = TEMPLATES_BAD[i]
        return f"template-{i}", h, p.data
    if area == "gen":
        g = json.loads(m["generation_config"])
        k = _pick(rng, ["bos_token_id", "eos_token_ids", "temperature", "top_p", "top_k", "list", "notjson"])
        vals = {
            "bos_token_id": ["1", -1, 10**6, 1.5, True],
            "eos_token_ids": [["a"], [-1], [10**9], 5, "x", [1.5]],
            "temperature": [-1, "hot", float("nan"), float("inf"), [0.7]],
            "top_p": [0, 2, "x", -0.5, float("nan")],
            "top_k": [-1, 1.5, "3", 10**30],
        }
        if k in ("list", "notjson"):
            m["generation_config"] = {"list": "[]", "notjson": "{temperature"}[k]
        else:
            g[k] = vals[k][int(rng.integers(len(vals[k])))]
            m["generation_config"] = json.dumps(g)
        return f"gen-{k}={g.get(k)!r}", h, p.data
    if area == "format":
        how = _pick(rng, ["name", "version", "version-int", "no-version", "no-format"])
        if how == "name":
            m["format"] = "safetensors"
        elif how == "version":
            m["format_version"] = _pick(rng, ["99", "0", "", "1.0"])  # never a version a later reader takes
        elif how == "version-int":
            m["format_version"] = 1
        elif how == "no-version":
            del m["format_version"]
        else:
            del m["format"]
        return f"format-{how}", h, p.data
    if area == "types":
        how = _pick(rng, ["meta-list", "meta-null", "meta-str", "no-meta", "value-int", "value-dict", "created-int"])
        if how == "meta-list":
            h["__metadata__"] = [m]
        elif how == "meta-null":
            h["__metadata__"] = None
        elif how == "meta-str":
            h["__metadata__"] = "atomflow"
        elif how == "no-meta":
            del h["__metadata__"]
        elif how == "value-int":
            m["format_version"] = 1
        elif how == "value-dict":
            m["spec"] = json.loads(m["spec"])
        else:
            m["created_by"] = 5
        return f"types-{how}", h, p.data
    if area == "checksum":
        how = _pick(rng, ["remove", "md5", "short"])
        if how == "remove":
            del m["checksum"]
        else:
            m["checksum"] = {"md5": "md5:" + "0" * 32, "short": "sha256:abc"}[how]
        h["__metadata__"] = m
        return f"checksum-{how}", h, p.data
    how = _pick(rng, ["list", "notjson", "int"])
    m["source"] = {"list": "[]", "notjson": "{repo", "int": "5"}[how]
    return f"source-{how}", h, p.data


def _values_op(p: Parsed, rng) -> tuple[str, dict, bytes]:
    """NaN / Inf / absurd numbers planted in the data region, checksums re-signed."""
    h = p.header
    names = _tensor_names(h)
    data = bytearray(p.data)
    kind = _pick(rng, ["scale", "fp8", "bf16"])
    pool = [
        n
        for n in names
        if (n.endswith(".scale") if kind == "scale" else h[n]["dtype"] == ("F8_E4M3" if kind == "fp8" else "BF16"))
    ]
    t = str(_pick(rng, pool))
    b, end = h[t]["data_offsets"]
    if kind == "scale":
        v = _pick(rng, [np.nan, np.inf, -np.inf, 3e38, 0.0, -1.0])
        j = b + 4 * int(rng.integers((end - b) // 4))
        data[j : j + 4] = np.float32(v).tobytes()
    elif kind == "fp8":
        v = _pick(rng, [0x7F, 0xFF])
        data[b + int(rng.integers(end - b))] = int(v)
    else:
        v = _pick(rng, [0x7FC0, 0x7F80, 0xFF80])  # NaN, +Inf, -Inf
        j = b + 2 * int(rng.integers((end - b) // 2))
        data[j : j + 2] = struct.pack("<H", int(v))
        v = hex(int(v))
    return f"values-{kind}-{t}={v}", h, bytes(data)


def make_variant(base: bytes, seed: int, index: int) -> tuple[str, str, bytes]:
    """(kind, name, bytes) of variant `index`: deterministic in (seed, index)."""
    rng = np.random.default_rng([seed, index])
    p = parse(base)
    data0 = 8 + p.n
    kind = _pick(
        rng, ["truncate", "append", "bitflip", "length", "table", "meta", "values"], [0.08, 0.04, 0.17, 0.05, 0.25, 0.33, 0.08]
    )
    if kind == "truncate":
        where = _pick(rng, ["prefix", "header", "exact", "data", "last"])
        cut = {
            "prefix": int(rng.integers(0, 8)),
            "header": int(rng.integers(8, data0)),
            "exact": data0,
            "data": int(rng.integers(data0, len(base))),
            "last": len(base) - 1,
        }[where]
        return kind, f"truncate-{where}-{cut}", base[:cut]
    if kind == "append":
        k = int(_pick(rng, [1, 7, 8, 4096]))
        return kind, f"append-{k}", base + rng.bytes(k)
    if kind == "bitflip":
        region = _pick(rng, ["prefix", "header", "data"], [0.1, 0.5, 0.4])
        lo, hi = {"prefix": (0, 8), "header": (8, data0), "data": (data0, len(base))}[region]
        raw = bytearray(base)
        flips = []
        for _ in range(int(rng.integers(1, 4))):
            j = int(rng.integers(lo, hi))
            bit = int(rng.integers(8))
            raw[j] ^= 1 << bit
            flips.append(f"{j}.{bit}")
        return ("bitflip-data" if region == "data" else "bitflip"), f"bitflip-{region}-{'+'.join(flips)}", bytes(raw)
    if kind == "length":
        n = p.n
        new = int(
            _pick(rng, [0, 1, 2, n - 1, n - 8, n + 1, n + 8, 2 * n, len(base), 2**63, 2**64 - 1, int(rng.integers(0, len(base)))])
        )
        return kind, f"length-{new}", struct.pack("<Q", new) + base[8:]
    if kind == "table":
        name, h, data = _table_op(p, rng)
        return kind, name, pack(h, data)
    if kind == "meta":
        name, h, data = _meta_op(p, rng)
        return kind, name, pack(h, data)
    name, h, data = _values_op(p, rng)
    return kind, name, pack(h, data)


# -- running one variant -----------------------------------------------------------------------
class _Timeout(BaseException):
    pass


def _on_alarm(signum, frame):
    raise _Timeout()


def run_mode(path: Path, mode: str) -> None:
    from atomflow import cli

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        if mode == "info":
            cli.cmd_info(Namespace(model=str(path), verify=True, json=True))
        else:
            cli.cmd_run(
                Namespace(
                    model=str(path),
                    prompt="Hello",
                    max_new_tokens=2,
                    temperature=None,
                    top_k=None,
                    top_p=None,
                    seed=1,
                    stop=None,
                    ignore_eos=True,
                    raw=False,
                    backend="cpu",
                    max_context=64,
                    eager=False,
                    verbose=False,
                    quiet=True,
                    speculate=None,
                )
            )


def classify(path: Path, mode: str, time_limit: float = TIME_LIMIT_S) -> tuple[str, str]:
    from atomflow.errors import AtomflowError

    old = signal.signal(signal.SIGALRM, _on_alarm)
    signal.setitimer(signal.ITIMER_REAL, time_limit)
    try:
        try:
            run_mode(path, mode)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old)
    except _Timeout:
        return "timeout", ""
    except MemoryError:
        return "oom", ""
    except AtomflowError as e:
        msg = str(e)
        return ("error" if msg.strip() and "\n" not in msg.strip() else "multiline"), msg[:300]
    except (ValueError, OSError, RuntimeError) as e:
        return "generic", f"{type(e).__name__}: {str(e)[:300]}"
    except BaseException as e:  # noqa: B036 - the point is to see every kind of failure
        return "traceback", f"{type(e).__name__}: {str(e)[:300]}"
    return "accepted", ""


def _one(base: bytes, seed: int, index: int, workdir: Path, modes) -> dict:
    if index < 0:
        kind, name, blob = "base", "base", base
    else:
        kind, name, blob = make_variant(base, seed, index)
    path = workdir / f"v{os.getpid()}.atomflow"
    path.write_bytes(blob)
    res = dict(index=index, kind=kind, name=name, identical=blob == base)
    for mode in modes:
        t0 = time.perf_counter()
        res[mode] = classify(path, mode)
        res[mode + "_s"] = time.perf_counter() - t0
    path.unlink()
    return res


def _worker(base: bytes, seed: int, indices: list[int], workdir: Path, modes, wfd: int) -> None:
    """A forked worker: runs its variants one after another, each announced before it starts
    ("start i") so that the parent can name the one that killed or hung it."""
    vm = int(open("/proc/self/statm").read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    resource.setrlimit(resource.RLIMIT_AS, (vm + MEMORY_LIMIT, resource.RLIM_INFINITY))
    for index in indices:
        os.write(wfd, f"start {index}\n".encode())
        os.write(wfd, (json.dumps(_one(base, seed, index, workdir, modes)) + "\n").encode())


def run_variants(
    base: bytes, seed: int, indices, workdir: Path, modes=MODES, workers: int = 2, hard_limit_s: float = 60.0
) -> list[dict]:
    """The variants split over `workers` forked processes (a fork per worker, not per variant: a
    fork of a big test process costs more than a variant). A worker that dies (memory limit, a
    crash) or makes no progress for hard_limit_s has its current variant recorded as crash /
    timeout, and a fresh worker takes the rest of its share."""
    import atomflow.backends.cpu  # noqa: F401 - imported once here, not in every worker
    import atomflow.cli  # noqa: F401
    import atomflow.engine  # noqa: F401
    import atomflow.model.tokenizer  # noqa: F401

    indices = list(indices)
    shares = [indices[i::workers] for i in range(workers)]
    running, results = {}, []

    def start(share: list[int]) -> None:
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                os.close(r)
                _worker(base, seed, share, workdir, modes, w)
            except BaseException:  # noqa: B036
                code = 3
            finally:
                os._exit(code)
        os.close(w)
        running[pid] = dict(fd=r, share=list(share), current=None, t=time.monotonic(), buf=b"")

    def lost(pid: int, why: str, outcome: str) -> None:
        st = running.pop(pid)
        os.close(st["fd"])
        if st["current"] is not None:
            res = _result(st["current"], b"", 0, base, seed, modes)
            for m in modes:
                res[m] = (outcome, why)
            results.append(res)
            rest = st["share"][st["share"].index(st["current"]) + 1 :]
            if rest:
                start(rest)

    for share in shares:
        if share:
            start(share)
    while running:
        fds = {st["fd"]: pid for pid, st in running.items()}
        ready, _, _ = select.select(list(fds), [], [], 0.5)
        for fd in ready:
            pid = fds[fd]
            st = running[pid]
            chunk = os.read(fd, 1 << 16)
            if not chunk:  # the worker ended: done, or killed mid-variant
                _, status = os.waitpid(pid, 0)
                why = f"killed by signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status) else f"exit status {status}"
                lost(pid, why, "crash")
                continue
            st["buf"] += chunk
            *lines, st["buf"] = st["buf"].split(b"\n")
            for line in lines:
                st["t"] = time.monotonic()
                if line.startswith(b"start "):
                    st["current"] = int(line.split()[1])
                else:
                    results.append(json.loads(line))
                    st["current"] = None
        for pid, st in list(running.items()):
            if time.monotonic() - st["t"] > hard_limit_s:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                lost(pid, "killed past the hard limit", "timeout")
    return sorted(results, key=lambda r: r["index"])


def _result(index, buf, status, base, seed, modes) -> dict:
    kind, name = ("base", "base") if index < 0 else make_variant(base, seed, index)[:2]
    return dict(index=index, kind=kind, name=name, identical=False, **{m: ("crash", f"status {status}") for m in modes})


def failures(res: dict, modes=MODES) -> list[str]:
    """What is wrong with one result: every mode must end in `error`, except that `run` may
    accept a file whose damage lies only in the data (no --verify)."""
    if res["identical"]:
        return []
    bad = []
    for m in modes:
        outcome = res[m][0]
        if outcome == "error" or (m == "run" and outcome == "accepted" and res["kind"] in _NAN_OK_KINDS):
            continue
        bad.append(f"{m}: {outcome} {res[m][1]}")
    return bad


def summarize(results: list[dict], modes=MODES) -> str:
    lines = [f"{len(results)} variants ({sum(r['identical'] for r in results)} identical to the base)"]
    kinds = collections.Counter(r["kind"] for r in results)
    lines.append("kinds: " + ", ".join(f"{k} {v}" for k, v in sorted(kinds.items())))
    for m in modes:
        c = collections.Counter(r[m][0] for r in results if not r["identical"])
        lines.append(f"{m:5s} " + ", ".join(f"{k} {v}" for k, v in sorted(c.items())))
        tb = collections.Counter(r[m][1].split(":")[0] for r in results if r[m][0] in ("traceback", "generic"))
        if tb:
            lines.append("      by exception: " + ", ".join(f"{k} {v}" for k, v in tb.most_common()))
        acc = collections.Counter(r["kind"] for r in results if r[m][0] == "accepted" and not r["identical"])
        if acc:
            lines.append("      accepted by kind: " + ", ".join(f"{k} {v}" for k, v in sorted(acc.items())))
        slow = max((r.get(m + "_s", 0) for r in results), default=0)
        lines.append(f"      slowest {slow:.2f} s")
    lines.append(f"failing variants: {sum(bool(failures(r, modes)) for r in results)}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--show", type=int, default=20, help="failing variants to print")
    ap.add_argument("--json", default=None, help="write every result here")
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        base = build_base(work).read_bytes()
        t0 = time.perf_counter()
        [b] = run_variants(base, a.seed, [-1], work, workers=1)
        assert all(b[m][0] == "accepted" for m in MODES), f"the base file does not run: {b}"
        results = run_variants(base, a.seed, range(a.variants), work, workers=a.workers)
        dt = time.perf_counter() - t0
    print(summarize(results))
    print(f"{dt:.1f} s")
    bad = [r for r in results if failures(r)]
    for r in bad[: a.show]:
        print(f"  #{r['index']} {r['name'][:80]}: " + " | ".join(failures(r))[:300])
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
