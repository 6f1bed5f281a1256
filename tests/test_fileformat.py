"""The .atomflow container: readable by safetensors itself, and every kind of damage rejected
with a one-line FormatError (never a crash)."""

import json
import shutil
import struct

import numpy as np
import pytest

from atomflow.errors import FormatError
from atomflow.model.fileformat import AtomflowFile, FileWriter, TensorInfo, encode_header, expected_tensors


def test_table_matches_spec_and_checksum_verifies(tiny_model_file):
    with AtomflowFile(tiny_model_file, verify=True) as m:
        names = [t["name"] for t in m.tensor_table()]
        assert names == [t.name for t in expected_tensors(m.spec, "fp8")]
        assert m.checksum.startswith("sha256:") and len(m.checksum) == 71
        assert m.metadata_json("generation_config")["eos_token_ids"]
        # offsets are absolute and back to back
        table = m.tensor_table()
        assert table[0]["offset"] == m.data_offset
        for a, b in zip(table, table[1:]):
            assert a["offset"] + a["nbytes"] == b["offset"]
        assert table[-1]["offset"] + table[-1]["nbytes"] == m.file_size


def test_safetensors_opens_it(tiny_model_file):
    torch = pytest.importorskip("torch")
    from safetensors import safe_open

    with safe_open(str(tiny_model_file), "pt") as f, AtomflowFile(tiny_model_file) as m:
        assert set(f.keys()) == set(m.tensors)
        assert f.metadata()["format"] == "atomflow"
        w = f.get_tensor("layers.0.wqkv")
        assert w.dtype == torch.float8_e4m3fn
        np.testing.assert_array_equal(w.view(torch.uint8).numpy(), m.array("layers.0.wqkv").view(np.uint8))
        assert f.get_tensor("embed").dtype == torch.bfloat16


def _copy(src, tmp_path, name="m.atomflow"):
    dst = tmp_path / name
    shutil.copyfile(src, dst)
    return dst


def _rewrite_header(path, fn):
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    fn(header)
    new = encode_header(header)  # re-sealed: only the structural checks can catch the change
    path.write_bytes(struct.pack("<Q", len(new)) + new + raw[8 + n :])


@pytest.mark.parametrize(
    "damage,needle",
    [
        ("empty", "too short"),
        ("garbage", "does not fit"),
        ("not-json", "not JSON"),
        ("plain-safetensors", 'no "format": "atomflow"'),
        ("version", "format version '99' is not supported"),
        ("truncated", "truncated"),
        ("missing-tensor", "missing: ['layers.1.wo']"),
        ("wrong-shape", "the spec needs"),
        ("bad-spec", "bad spec"),
    ],
)
def test_damage_is_rejected(tiny_model_file, tmp_path, damage, needle):
    p = _copy(tiny_model_file, tmp_path)
    if damage == "empty":
        p.write_bytes(b"")
    elif damage == "garbage":
        p.write_bytes(b"\xff" * 64)
    elif damage == "not-json":
        p.write_bytes(struct.pack("<Q", 16) + b"{this is not js}" + b"\0" * 32)
    elif damage == "plain-safetensors":
        _rewrite_header(p, lambda h: h.pop("__metadata__"))
    elif damage == "version":
        _rewrite_header(p, lambda h: h["__metadata__"].update(format_version="99"))
    elif damage == "truncated":
        p.write_bytes(p.read_bytes()[:-1000])
    elif damage == "missing-tensor":
        _rewrite_header(p, lambda h: h.pop("layers.1.wo"))
    elif damage == "wrong-shape":

        def f(h):
            e = h["layers.0.attn_norm"]
            e["shape"], e["dtype"] = [e["shape"][0] // 2], "F32"

        _rewrite_header(p, f)
    elif damage == "bad-spec":
        _rewrite_header(p, lambda h: h["__metadata__"].update(spec='{"vocab_size": 3}'))
    with pytest.raises(FormatError) as e:
        AtomflowFile(p)
    assert needle in str(e.value)
    assert "\n" not in str(e.value)


def test_flipped_data_byte_fails_checksum_only_with_verify(tiny_model_file, tmp_path):
    p = _copy(tiny_model_file, tmp_path)
    raw = bytearray(p.read_bytes())
    raw[-5] ^= 0x40
    p.write_bytes(bytes(raw))
    AtomflowFile(p).close()  # structure intact: opens without --verify
    with pytest.raises(FormatError, match="checksum mismatch"):
        AtomflowFile(p, verify=True)


def test_missing_file():
    with pytest.raises(FileNotFoundError, match="no such model file"):
        AtomflowFile("/nonexistent/x.atomflow")


def test_writer_leaves_nothing_on_failure(tmp_path):
    out = tmp_path / "x.atomflow"
    tensors = [TensorInfo("a", "F32", (4,)), TensorInfo("b", "F32", (2,))]
    with pytest.raises(RuntimeError):
        with FileWriter(out, tensors, {"format": "atomflow"}) as w:
            w.write("a", np.ones(4, np.float32))
            raise RuntimeError("interrupted")
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError, match="expected tensor 'a' next"):
        with FileWriter(out, tensors, {}) as w:
            w.write("b", np.ones(2, np.float32))
    with pytest.raises(ValueError, match="not fully written"):
        with FileWriter(out, tensors, {}) as w:
            w.write("a", np.ones(4, np.float32))
    assert list(tmp_path.iterdir()) == []


def _edit_spec(**kw):
    def f(h):
        spec = json.loads(h["__metadata__"]["spec"])
        spec.update(kw)
        h["__metadata__"]["spec"] = json.dumps(spec)

    return f


def _edit_quant(**kw):
    def f(h):
        h["__metadata__"]["quantization"] = json.dumps(dict(json.loads(h["__metadata__"]["quantization"]), **kw))

    return f


def _swap_offsets(a, b):
    def f(h):
        h[a]["data_offsets"], h[b]["data_offsets"] = h[b]["data_offsets"], h[a]["data_offsets"]

    return f


@pytest.mark.parametrize(
    "edit,needle",
    [
        (
            lambda h: h["final_norm"].update(
                data_offsets=[h["final_norm"]["data_offsets"][0] - 8, h["final_norm"]["data_offsets"][1] - 8]
            ),
            "overlaps",
        ),
        (_swap_offsets("layers.0.attn_norm", "layers.0.mlp_norm"), "is stored at position 1 of the data region"),
        (lambda h: h["embed"].update(shape=[2**62, 256]), "malformed shape"),
        (lambda h: h["embed"].update(shape=[2**20, 256]), "do not match shape"),
        (lambda h: h["embed"].update(data_offsets=[0, None]), "malformed data_offsets"),
        (_edit_spec(num_layers=10**9), "num_layers must be an int in [0, 4096]"),
        (_edit_spec(num_layers=4000), "4000 layers"),
        (_edit_spec(hidden_size="256"), "hidden_size must be an int"),
        (_edit_spec(rope_theta=float("inf")), "Infinity is not JSON"),
        (_edit_spec(rope_theta=1e39), "rope_theta must be a float"),
        (_edit_spec(tie_word_embeddings=1), "tie_word_embeddings must be a bool"),
        (_edit_spec(lm_head_fp8=False), "quantization.lm_head 'fp8' disagrees with the spec"),
        (_edit_quant(scheme="int4_awq"), "quantization scheme 'int4_awq' is not supported"),
        (_edit_quant(group_size=64), "quantization.group_size says 64, but 'layers.0.w13.scale'"),
        (_edit_quant(scale_dtype="BF16"), "quantization.scale_dtype says BF16, but 'layers.0.w13.scale' is F32"),
        (_edit_quant(lm_head="bf16"), "quantization.lm_head 'bf16' disagrees with the spec"),
        (
            lambda h: h["__metadata__"].update(generation_config=json.dumps({"eos_token_ids": [10**6]})),
            "generation_config.eos_token_ids is invalid",
        ),
        (lambda h: h["__metadata__"].update(source="[]"), "metadata 'source' is a JSON list"),
        (lambda h: h["__metadata__"].update(created_by=5), "metadata 'created_by' is a int"),
    ],
)
def test_structural_damage_is_named(tiny_model_file, tmp_path, edit, needle):
    """Damage re-sealed with a valid header checksum: only the structural checks can catch it."""
    p = _copy(tiny_model_file, tmp_path)
    _rewrite_header(p, edit)
    with pytest.raises(FormatError) as e:
        AtomflowFile(p)
    assert needle in str(e.value) and str(p) in str(e.value) and "\n" not in str(e.value)


def test_trailing_bytes_and_short_header_length(tiny_model_file, tmp_path):
    p = _copy(tiny_model_file, tmp_path)
    p.write_bytes(p.read_bytes() + b"\0" * 8)
    with pytest.raises(FormatError, match="8 trailing bytes after the last tensor"):
        AtomflowFile(p)
    raw = tiny_model_file.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    p.write_bytes(struct.pack("<Q", n - 8) + raw[8:])
    with pytest.raises(FormatError, match="header is not JSON"):
        AtomflowFile(p)


def test_header_checksum_covers_the_metadata(tiny_model_file, tmp_path):
    """An edited spec, tokenizer or template is refused at load, without --verify."""
    p = _copy(tiny_model_file, tmp_path)
    raw = p.read_bytes()
    assert b'"header_checksum":"sha256:' in raw
    p.write_bytes(raw.replace(b'\\"rms_norm_eps\\": 1e-05', b'\\"rms_norm_eps\\": 2e-05', 1))
    assert p.read_bytes() != raw
    with pytest.raises(FormatError, match="header checksum mismatch"):
        AtomflowFile(p)


def test_file_without_header_checksum_still_loads(tiny_model_file, tmp_path):
    """Files written before header_checksum existed: loaded and verified, the header unchecked."""
    p = _copy(tiny_model_file, tmp_path)
    raw = p.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    del header["__metadata__"]["header_checksum"]
    new = json.dumps(header, separators=(",", ":")).encode()
    new += b" " * (-(8 + len(new)) % 8)
    p.write_bytes(struct.pack("<Q", len(new)) + new + raw[8 + n :])
    with AtomflowFile(p, verify=True) as m, AtomflowFile(tiny_model_file, verify=True) as ref:
        assert not m.header_checked and ref.header_checked
        assert m.spec == ref.spec
