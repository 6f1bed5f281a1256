"""`atomflow sandbox ...` on the CPU: the subcommands register and parse, test-blocks passes, the
bench's CPU parts (memory, prefix hit rate) produce their tables and JSON, and every GPU part's
Python driver runs end to end against a stand-in for the extension's GPU functions (so a typo in
a driver cannot waste a GPU run). The GPU numbers themselves come from tests/test_sandbox_gpu.py
and the real bench."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest

_sandbox = pytest.importorskip("atomflow._sandbox", reason="the sandbox extension is not built")

from atomflow.sandbox import bench as sandbox_bench  # noqa: E402
from atomflow.sandbox import model as sandbox
from atomflow.sandbox import scheduler as sandbox_scheduler
from atomflow.sandbox.cli import register  # noqa: E402


def run_cli(*argv) -> int:
    p = argparse.ArgumentParser(prog="atomflow")
    sub = p.add_subparsers(dest="command", required=True)
    register(sub)
    a = p.parse_args(list(argv))
    return a.fn(a)


def test_register_adds_both_subcommands():
    p = argparse.ArgumentParser(prog="atomflow")
    register(p.add_subparsers(dest="command", required=True))
    a = p.parse_args(["sandbox", "bench", "--quick", "--parts", "memory"])
    assert a.sandbox_command == "bench" and a.quick and callable(a.fn)
    a = p.parse_args(["sandbox", "test-blocks", "--ops", "10"])
    assert a.sandbox_command == "test-blocks" and a.ops == 10
    with pytest.raises(SystemExit):
        p.parse_args(["sandbox"])


def test_test_blocks_command(capsys):
    assert run_cli("sandbox", "test-blocks", "--ops", "3000", "--runs", "10", "--seed", "3") == 0
    out = capsys.readouterr().out
    assert "every invariant held, nothing leaked" in out and "equals single-stream generation" in out


def test_bench_cpu_parts(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(sandbox, "cuda_status", lambda: (False, "no GPU here"))
    out_json = tmp_path / "r.json"
    assert run_cli("sandbox", "bench", "--quick", "--json", str(out_json)) == 0
    res = json.loads(out_json.read_text())
    assert "attention" not in res and "decode" not in res
    assert res["memory"]["rows"] and res["prefix"]["hit_rate"] > 0.8 and not res["prefix"]["gpu"]
    assert any("to be measured" in n for n in res["notes"])
    assert "KV memory" in capsys.readouterr().out
    with pytest.raises(ValueError, match="--parts"):
        run_cli("sandbox", "bench", "--parts", "nonsense")


# ----------------------------------------------------------------------------- a stand-in GPU


class FakePagedModel:
    """_sandbox.PagedModel's interface over FakeModel: checks uploads like the C++ does."""

    def __init__(self, dims, num_blocks, block_size, max_rows, max_seqs, max_blocks_per_seq, f16_activations=True):
        assert isinstance(f16_activations, bool)
        self.dims, self.uploaded = dims, set()
        self.fake = sandbox.FakeModel(
            num_blocks,
            block_size,
            dims["vocab_size"],
            max_batch=max_seqs,
            prefill_chunk=max_rows - max_seqs,
            max_context=max_blocks_per_seq * block_size,
            strict=False,
        )  # the decode bench runs on synthetic (unwritten) KV
        self.max_rows, self.max_seqs, self.max_blocks_per_seq = max_rows, max_seqs, max_blocks_per_seq
        self.last_step_ms, self.pool_bytes, self.weight_bytes, self.block_bytes = 0.5, 1 << 30, 1 << 28, 1 << 16

    def upload(self, name, array):
        assert array.dtype == np.uint8 and array.flags.c_contiguous
        self.uploaded.add(name)

    def upload_inv_freq(self, f):
        assert f.dtype == np.float32 and f.shape == (self.dims["head_dim"] // 2,)

    def step(
        self,
        tokens,
        positions,
        slots,
        n_decode,
        decode_tables=None,
        decode_lens=None,
        prefill_table=None,
        prefill_len=0,
        logit_rows=None,
        want_logits=False,
    ):
        for a in (tokens, positions, slots, logit_rows):
            assert a.dtype == np.int32 and a.ndim == 1
        assert len(tokens) <= self.max_rows and n_decode <= self.max_seqs
        if n_decode:
            assert decode_tables.dtype == np.int32 and decode_tables.shape[0] == n_decode
            assert decode_tables.shape[1] <= self.max_blocks_per_seq and decode_lens.dtype == np.int32
        assert "lm_head" in self.uploaded and "embed" in self.uploaded
        nxt = self.fake.step(
            tokens, positions, slots, n_decode, decode_tables, decode_lens, prefill_table, prefill_len, logit_rows
        )
        return (nxt, np.zeros((len(nxt), self.dims["vocab_size"]), np.float32)) if want_logits else nxt

    def copy_blocks(self, pairs):
        assert pairs.dtype == np.int32 and pairs.shape[1] == 2
        self.fake.copy_blocks(pairs.tolist())

    def clear_pool(self):
        self.fake.clear()


class FakeExt:
    BlockManager, OutOfBlocks = _sandbox.BlockManager, _sandbox.OutOfBlocks
    PagedModel = FakePagedModel

    @staticmethod
    def cuda_available():
        return True, ""

    @staticmethod
    def device_info():
        return "Fake GPU", 80 << 30, 70 << 30

    @staticmethod
    def stream_read_gbs(n, iters):
        return 4000.0

    @staticmethod
    def time_attention(layout, lens, H, Hkv, D, block_size, scatter, iters, seed):
        assert layout in ("contiguous", "paged") and all(isinstance(n, int) for n in lens)
        return (5.0 + sum(lens) * Hkv * D * 4 / 3.5e6) * (1.05 if layout == "paged" else 1.0)


def test_bench_gpu_drivers_against_a_stand_in(tiny_model_file, tmp_path, monkeypatch, capsys):
    for mod in (sandbox, sandbox_bench, sandbox_scheduler):
        monkeypatch.setattr(mod, "ext", lambda: FakeExt)
    out_json = tmp_path / "r.json"
    assert (
        run_cli(
            "sandbox",
            "bench",
            "--model",
            str(tiny_model_file),
            "--quick",
            "--no-core",
            "--contexts",
            "512,4096",
            "--batches",
            "1,4",
            "--lengths",
            "16:64",
            "--steps",
            "3",
            "--prefix",
            "4,64,8,4",
            "--json",
            str(out_json),
            "--plots",
            str(tmp_path / "plots"),
        )
        == 0
    )
    res = json.loads(out_json.read_text())
    assert {r["layout"] for r in res["attention"]["rows"]} == {"contiguous", "paged"}
    assert all(abs(r["overhead"] - 1.05) < 0.01 for r in res["attention"]["rows"] if r["layout"] == "paged")
    assert [r["batch"] for r in res["decode"]["rows"]] == [1, 4] and res["decode"]["rows"][1]["tokens_per_s"] > 0
    assert res["prefix"]["gpu"] and res["prefix"]["prefill_rows_on"] < res["prefix"]["prefill_rows_off"]
    out = capsys.readouterr().out
    assert "decode attention" in out and "batched decode" in out and "prefix caching" in out
