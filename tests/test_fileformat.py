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
    header = json.loads(raw[8:8 + n])
    fn(header)
    new = encode_header(header)  # re-sealed: only the structural checks can catch the change
    path.write_bytes(struct.pack("<Q", len(new)) + new + raw[8 + n:])


@pytest.mark.parametrize("damage,needle", [
    ("empty", "too short"),
    ("garbage", "does not fit"),
    ("not-json", "not JSON"),
    ("plain-safetensors", "no \"format\": \"atomflow\""),
    ("version", "format version '99' is not supported"),
    ("truncated", "truncated"),
    ("missing-tensor", "missing: ['layers.1.wo']"),
    ("wrong-shape", "the spec needs"),
    ("bad-spec", "bad spec"),
])
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
        _rewrite_header(p, lambda h: h["__metadata__"].update(spec="{\"vocab_size\": 3}"))
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
