"""The CLI's error contract, table-driven: every bad invocation, bad file and bad model directory
ends in exactly one stderr line `atomflow: error: ...` naming the file and the problem, exit code
1, nothing on stdout, and no new file in the output directory. Run in-process (cli.main) for
speed; a few go through a real subprocess to prove the exit code and the absence of a traceback."""

import json
import os
import shutil
import struct
import subprocess
import sys

import numpy as np
import pytest

from atomflow import cli
from atomflow.model.fileformat import AtomflowFile, encode_header


def run_cli(capsys, *args) -> tuple[int, str, str]:
    try:
        rc = cli.main([str(a) for a in args])
    except SystemExit as e:  # argparse
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


def assert_one_line(rc, out, err, *needles):
    assert rc == 1, (rc, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("atomflow: error: "), err
    for n in needles:
        assert str(n) in lines[0], (n, lines[0])
    assert "Traceback" not in err and out.strip() == "", (out, err)
    return lines[0]


# -- bad model files and run/info arguments ------------------------------------------------------
def _edit_header(src, dst, fn, reseal=True):
    raw = src.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    fn(header)
    new = encode_header(header) if reseal else json.dumps(header, separators=(",", ":")).encode()
    new += b" " * (-(8 + len(new)) % 8)
    dst.write_bytes(struct.pack("<Q", len(new)) + new + raw[8 + n :])


def _nan_final_norm(src, dst):
    """NaN in final_norm, checksums re-signed: structurally valid, every logit NaN."""
    with AtomflowFile(src) as m:
        t = m.tensors["final_norm"]
        b = t.offset - m.data_offset
    raw = src.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    data = bytearray(raw[8 + n :])
    data[b : b + 2] = struct.pack("<H", 0x7FC0)
    header = json.loads(raw[8 : 8 + n])
    import hashlib

    header["__metadata__"]["checksum"] = "sha256:" + hashlib.sha256(bytes(data)).hexdigest()
    new = encode_header(header)
    dst.write_bytes(struct.pack("<Q", len(new)) + new + bytes(data))


@pytest.fixture
def files(tiny_model_file, tiny_hf_dir, tmp_path):
    d = tmp_path / "files"
    d.mkdir()
    (d / "empty.atomflow").write_bytes(b"")
    (d / "random.atomflow").write_bytes(np.random.default_rng(0).bytes(4096))
    (d / "dir.atomflow").mkdir()
    shutil.copyfile(tiny_hf_dir / "model-00001-of-00002.safetensors", d / "foreign.safetensors")
    _edit_header(tiny_model_file, d / "v2.atomflow", lambda h: h["__metadata__"].update(format_version="99"))
    _edit_header(
        tiny_model_file, d / "edited.atomflow", lambda h: h["__metadata__"].update(chat_template="{{ messages }}"), reseal=False
    )
    _edit_header(
        tiny_model_file,
        d / "gap.atomflow",
        lambda h: h["final_norm"].update(data_offsets=[x + 8 for x in h["final_norm"]["data_offsets"]]),
    )
    _edit_header(
        tiny_model_file,
        d / "group.atomflow",
        lambda h: h["__metadata__"].update(
            quantization=json.dumps(dict(json.loads(h["__metadata__"]["quantization"]), group_size=64))
        ),
    )
    _edit_header(
        tiny_model_file,
        d / "template.atomflow",
        lambda h: h["__metadata__"].update(chat_template="{{ raise_exception('no system role') }}"),
    )
    _nan_final_norm(tiny_model_file, d / "nan.atomflow")
    raw = bytearray(tiny_model_file.read_bytes())
    raw[-5] ^= 0x40
    (d / "flipped.atomflow").write_bytes(bytes(raw))
    return d


RUN = ["-p", "Hello", "-n", "2", "--backend", "cpu", "--max-context", "64", "-q"]
FILE_CASES = [  # (argv with {f}=files dir / {m}=the valid model, needles; {path} = the file named)
    (["run", "{f}/missing.atomflow", *RUN], ["no such model file", "{f}/missing.atomflow"]),
    (["run", "{f}/empty.atomflow", *RUN], ["too short", "{f}/empty.atomflow"]),
    (["run", "{f}/dir.atomflow", *RUN], ["is a directory", "{f}/dir.atomflow"]),
    (["run", "{f}/random.atomflow", *RUN], ["not an atomflow file", "{f}/random.atomflow"]),
    (["run", "{f}/foreign.safetensors", *RUN], ["not an atomflow file", "{f}/foreign.safetensors"]),
    (["run", "{f}/v2.atomflow", *RUN], ["format version '99' is not supported", "{f}/v2.atomflow"]),
    (["run", "{f}/edited.atomflow", *RUN], ["header checksum mismatch", "{f}/edited.atomflow"]),
    (["run", "{f}/gap.atomflow", *RUN], ["gap of 8 bytes", "{f}/gap.atomflow"]),
    (["run", "{f}/group.atomflow", *RUN], ["quantization.group_size says 64", "{f}/group.atomflow"]),
    (["run", "{f}/template.atomflow", *RUN], ["chat template failed to render", "no system role"]),
    (["run", "{f}/nan.atomflow", *RUN], ["the file's weights produce NaN/Inf", "{f}/nan.atomflow"]),
    (["run", "{f}/nan.atomflow", *RUN, "--temperature", "0"], ["produce NaN/Inf"]),
    (["run", "{f}/nan.atomflow", *RUN, "--temperature", "0.8", "--seed", "1"], ["produce NaN/Inf"]),
    (["info", "{f}/nan.atomflow", "--verify"], ["'final_norm' holds a NaN", "{f}/nan.atomflow"]),
    (["info", "{f}/flipped.atomflow", "--verify"], ["checksum mismatch", "{f}/flipped.atomflow"]),
    (["info", "{f}/dir.atomflow"], ["is a directory"]),
    (["info", "{f}/missing.atomflow"], ["no such model file"]),
    (["info", ""], ["no model file given (the path is empty)"]),
    (["run", "", *RUN], ["no model file given"]),
    (["info"], ["info: the following arguments are required: model"]),
    (["run", "{m}", *RUN, "--top-p", "1.5"], ["top_p must be in (0, 1]"]),
    (["run", "{m}", *RUN, "--top-p", "0"], ["top_p"]),
    (["run", "{m}", *RUN, "--temperature", "-1"], ["temperature"]),
    (["run", "{m}", *RUN, "--temperature", "nan"], ["temperature"]),
    (["run", "{m}", *RUN, "--top-k", "-3"], ["top_k"]),
    (["run", "{m}", *RUN, "--seed", "-1"], ["seed"]),
    (["run", "{m}", *RUN[:2], "-n", "0", *RUN[4:]], ["max_new_tokens"]),
    (["run", "{m}", *RUN, "-n", "abc"], ["invalid int value: 'abc'"]),
    (["run", "{m}", *RUN[:-5], "--backend", "tpu"], ["run: argument --backend: invalid choice: 'tpu'"]),
    (["run", "{m}", "--backend", "cpu"], ["the following arguments are required: -p/--prompt"]),
    (["run", "{m}", "-p", "word " * 80, "--backend", "cpu", "--max-context", "16", "-q"], ["does not fit max_context 16"]),
    (["run", "{m}", *RUN[:-3], "--max-context", "999999999", "-q"], ["max_context must be an integer in [1, 16384]"]),
    (["frobnicate"], ["invalid choice: 'frobnicate'"]),
    (["run", "{m}", *RUN, "--no-such-flag"], ["unrecognized arguments: --no-such-flag"]),
]


@pytest.mark.parametrize("argv,needles", FILE_CASES, ids=lambda v: " ".join(v)[:60] if isinstance(v, list) else None)
def test_bad_invocation_is_one_line(capsys, files, tiny_model_file, argv, needles):
    subst = dict(f=files, m=tiny_model_file)
    before = sorted(os.listdir(files))
    rc, out, err = run_cli(capsys, *[a.format(**subst) for a in argv])
    assert_one_line(rc, out, err, *[n.format(**subst) for n in needles])
    assert sorted(os.listdir(files)) == before


@pytest.mark.parametrize(
    "name,args",
    [
        ("nan.atomflow", ["run", "{p}", *RUN]),
        ("gap.atomflow", ["info", "{p}"]),
        ("template.atomflow", ["run", "{p}", *RUN]),
        (None, ["run", "--backend", "x"]),
    ],
)
def test_subprocess_exit_code_and_no_traceback(files, name, args):
    p = files / name if name else None
    r = subprocess.run(
        [sys.executable, "-m", "atomflow.cli", *[a.format(p=p) for a in args]], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 1, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr, r.stderr


def test_template_that_never_ends_is_bounded(capsys, tiny_model_file, tmp_path, monkeypatch):
    """jinja's sandbox bounds range(), not nested loops: the load-time render has a time limit."""
    import atomflow.model.tokenizer as tokenizer

    monkeypatch.setattr(tokenizer, "TEMPLATE_CHECK_S", 0.3)
    p = tmp_path / "loop.atomflow"
    loop = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    _edit_header(tiny_model_file, p, lambda h: h["__metadata__"].update(chat_template=loop))
    rc, out, err = run_cli(capsys, "run", p, *RUN)
    assert_one_line(rc, out, err, str(p), "did not render one user turn within 0.3 s")


# -- bad model directories at quantize -------------------------------------------------------------
def _json_edit(name, fn):
    def edit(hf):
        p = hf / name
        d = json.loads(p.read_text())
        d = fn(d) or d
        p.write_text(json.dumps(d))

    return edit


def _write(name, data):
    def edit(hf):
        (hf / name).write_bytes(data if isinstance(data, bytes) else data.encode())

    return edit


def _nan_in(tensor):
    """A NaN as the first element of `tensor` in whichever shard holds it (bf16 checkpoint)."""

    def edit(hf):
        shard = hf / json.loads((hf / "model.safetensors.index.json").read_text())["weight_map"][tensor]
        raw = bytearray(shard.read_bytes())
        (n,) = struct.unpack("<Q", raw[:8])
        begin = json.loads(raw[8 : 8 + n])[tensor]["data_offsets"][0]
        raw[8 + n + begin : 8 + n + begin + 2] = struct.pack("<H", 0x7FC0)
        shard.write_bytes(bytes(raw))

    return edit


def _rm(name):
    return lambda hf: (hf / name).unlink()


QUANTIZE_CASES = [  # (id, edit of a copy of the tiny HF directory, needles; {hf} = that directory)
    ("config-list", _json_edit("config.json", lambda c: [c]), ["{hf}/config.json: must hold a JSON object, got a list"]),
    ("config-not-json", _write("config.json", "{hidden_size: 1"), ["{hf}/config.json: not valid JSON"]),
    ("config-missing", _rm("config.json"), ["no config.json in {hf}"]),
    (
        "rope-scaling-str",
        _json_edit("config.json", lambda c: c.update(rope_scaling="llama3")),
        ["{hf}", "rope_scaling must be an object, got 'llama3'"],
    ),
    (
        "rope-factor-str",
        _json_edit("config.json", lambda c: c["rope_scaling"].update(factor="8")),
        ["rope_scaling.factor must be a finite number"],
    ),
    (
        "layers-huge",
        _json_edit("config.json", lambda c: c.update(num_hidden_layers=10**9)),
        ["{hf}/config.json: num_layers 1000000000 is past what atomflow reads (4096)"],
    ),
    (
        "layers-more",
        _json_edit("config.json", lambda c: c.update(num_hidden_layers=5)),
        ["num_hidden_layers 5, but the checkpoint holds 3 layers"],
    ),
    ("vocab-huge", _json_edit("config.json", lambda c: c.update(vocab_size=10**9)), ["vocab_size 1000000000 is past"]),
    ("hidden-str", _json_edit("config.json", lambda c: c.update(hidden_size="256")), ["hidden_size must be an integer"]),
    ("hidden-bool", _json_edit("config.json", lambda c: c.update(hidden_size=True)), ["hidden_size must be an integer"]),
    ("eps-null", _json_edit("config.json", lambda c: c.update(rms_norm_eps=None)), ["rms_norm_eps must be a number"]),
    ("tie-str", _json_edit("config.json", lambda c: c.update(tie_word_embeddings="yes")), ["tie_word_embeddings"]),
    (
        "arch-string",
        _json_edit("config.json", lambda c: c.update(architectures="NotALlamaForCausalLMAtAll")),
        ["architectures must be a list"],
    ),
    (
        "arch-lookalike",
        _json_edit("config.json", lambda c: c.update(architectures=["NotALlamaForCausalLMAtAll"])),
        ["unsupported architecture NotALlamaForCausalLMAtAll"],
    ),
    (
        "arch-prefix",
        _json_edit("config.json", lambda c: c.update(architectures=["LlamaForCausalLMV2"])),
        ["unsupported architecture LlamaForCausalLMV2"],
    ),
    ("arch-ints", _json_edit("config.json", lambda c: c.update(architectures=[5])), ["list of strings"]),
    (
        "arch-unknown",
        _json_edit("config.json", lambda c: c.update(architectures=["GPT2LMHeadModel"])),
        ["unsupported architecture GPT2LMHeadModel"],
    ),
    (
        "model-type-only",
        _json_edit("config.json", lambda c: c.update(architectures=None, model_type="gpt2")),
        ["unsupported architecture model_type 'gpt2'"],
    ),
    ("tokenizer-garbage", _write("tokenizer.json", "this is not a tokenizer"), ["{hf}/tokenizer.json", "does not load"]),
    ("tokenizer-empty-object", _write("tokenizer.json", "{}"), ["{hf}/tokenizer.json", "does not load"]),
    ("tokenizer-binary", _write("tokenizer.json", b"\xff\xfe\x00garbage"), ["{hf}/tokenizer.json: not UTF-8"]),
    ("tokenizer-missing", _rm("tokenizer.json"), ["no tokenizer.json"]),
    ("tokcfg-list", _write("tokenizer_config.json", "[]"), ["{hf}/tokenizer_config.json: must hold a JSON object"]),
    (
        "tokcfg-template-int",
        _json_edit("tokenizer_config.json", lambda c: c.update(chat_template=5)),
        ["chat_template must be a string"],
    ),
    ("tokcfg-bos-int", _json_edit("tokenizer_config.json", lambda c: c.update(bos_token=5)), ["bos_token must be a string"]),
    ("template-syntax", _write("chat_template.jinja", "{% if %}"), ["chat template does not compile"]),
    (
        "template-raises",
        _write("chat_template.jinja", "{{ raise_exception('roles must alternate') }}"),
        ["chat template failed to render", "roles must alternate"],
    ),
    (
        "gen-eos-str",
        _json_edit("generation_config.json", lambda c: c.update(eos_token_id="x")),
        ["{hf}/generation_config.json: eos_token_id must be token ids"],
    ),
    ("gen-eos-range", _json_edit("generation_config.json", lambda c: c.update(eos_token_id=[10**6])), ["eos_token_id"]),
    (
        "gen-temperature",
        _json_edit("generation_config.json", lambda c: c.update(temperature="hot")),
        ["temperature must be a number"],
    ),
    ("gen-list", _write("generation_config.json", "[1]"), ["generation_config.json: must hold a JSON object"]),
    (
        "index-no-map",
        _json_edit("model.safetensors.index.json", lambda c: {"metadata": {}}),
        ["{hf}/model.safetensors.index.json: no weight_map"],
    ),
    (
        "index-escape",
        _json_edit("model.safetensors.index.json", lambda c: c["weight_map"].update({"model.norm.weight": "../x.safetensors"})),
        ["must name a file in the same directory"],
    ),
    ("index-not-json", _write("model.safetensors.index.json", "{"), ["model.safetensors.index.json: not valid JSON"]),
    (
        "shard-garbage",
        _write("model-00002-of-00002.safetensors", "garbage" * 100),
        ["model-00002-of-00002.safetensors: not a readable safetensors file"],
    ),
    (
        "nan-weight",
        _nan_in("model.layers.1.mlp.down_proj.weight"),
        ["tensor 'model.layers.1.mlp.down_proj.weight' holds NaN or Inf (row 0)"],
    ),
    ("nan-norm", _nan_in("model.norm.weight"), ["tensor 'model.norm.weight' holds NaN or Inf"]),
    ("shard-missing", _rm("model-00002-of-00002.safetensors"), ["shard named in the index is missing"]),
]


@pytest.fixture
def hf_copy(tiny_hf_dir, tmp_path):
    dst = tmp_path / "hf"
    shutil.copytree(tiny_hf_dir, dst)
    return dst


@pytest.mark.parametrize("case,edit,needles", QUANTIZE_CASES, ids=[c[0] for c in QUANTIZE_CASES])
def test_bad_model_dir_is_one_line(capsys, hf_copy, tmp_path, case, edit, needles):
    edit(hf_copy)
    outdir = tmp_path / "out"
    outdir.mkdir()
    src_before = sorted(os.listdir(hf_copy))
    rc, out, err = run_cli(capsys, "quantize", hf_copy, "-o", outdir / "m.atomflow", "-q")
    assert_one_line(rc, out, err, *[n.format(hf=hf_copy) for n in needles])
    assert os.listdir(outdir) == [] and sorted(os.listdir(hf_copy)) == src_before


# -- the output path -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "case", ["directory", "empty", "no-parent", "exists", "source-shard", "source-shard-forced", "source-config-forced"]
)
def test_bad_output_path(capsys, hf_copy, tmp_path, case):
    outdir = tmp_path / "out"
    outdir.mkdir()
    existing = outdir / "m.atomflow"
    existing.write_bytes(b"keep me")
    out, extra, needle = {
        "directory": (outdir, [], "is a directory"),
        "empty": ("", [], "no output file given"),
        "no-parent": (tmp_path / "nope" / "m.atomflow", [], "does not exist"),
        "exists": (existing, [], "exists; pass --force to overwrite it"),
        "source-shard": (hf_copy / "model-00001-of-00002.safetensors", [], "of the source model"),
        "source-shard-forced": (hf_copy / "model-00001-of-00002.safetensors", ["--force"], "of the source model"),
        "source-config-forced": (hf_copy / "config.json", ["--force"], "is config.json of the source model"),
    }[case]
    shard = (hf_copy / "model-00001-of-00002.safetensors").read_bytes()
    rc, so, se = run_cli(capsys, "quantize", hf_copy, "-o", out, "-q", *extra)
    assert_one_line(rc, so, se, needle, out)
    assert os.listdir(outdir) == ["m.atomflow"] and existing.read_bytes() == b"keep me"
    assert (hf_copy / "model-00001-of-00002.safetensors").read_bytes() == shard
    assert not list(hf_copy.glob("*.tmp-*"))


def test_force_overwrites(capsys, hf_copy, tmp_path):
    out = tmp_path / "m.atomflow"
    out.write_bytes(b"old")
    rc, so, se = run_cli(capsys, "quantize", hf_copy, "-o", out, "-q", "--force")
    assert rc == 0, se
    AtomflowFile(out, verify=True).close()
    assert sorted(os.listdir(tmp_path)) == sorted(["hf", "m.atomflow"])


@pytest.mark.gpu
@pytest.mark.parametrize("temperature", ["0", "0.8"])
def test_cuda_generation_refuses_nan_weights(files, temperature, capsys):
    """The CUDA backend samples on the device; its generation checks the prompt prefill's logits,
    which NaN in the weights reaches: one line, exit 1, nothing sampled."""
    argv = ["run", str(files / "nan.atomflow"), "-p", "Hello there", "-n", "4", "--backend", "cuda", "-q"]
    assert cli.main([*argv, "--temperature", temperature]) == 1
    captured = capsys.readouterr()
    assert "produce NaN/Inf" in captured.err and len(captured.err.strip().splitlines()) == 1, captured.err
    assert captured.out.strip() == "", captured.out
