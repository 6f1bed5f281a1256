"""tools/sass_check.py: the decoder of the control bits and the burst rule, on synthetic SASS (so
the check itself can fail), and on the real GEMV when the CUDA disassembler is installed."""

import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import sass_check  # noqa: E402


def fake_sass(instrs: list[tuple[str, int, int]]) -> str:
    """cuobjdump-like text of one function: (instruction, write scoreboard, wait mask) each."""
    out = ["\n\tFunction : _ZN8atomflow7kernels17gemv_w8a16_kernelIfake"]
    for n, (ins, wb, wait) in enumerate(instrs):
        hi = ((wait << 11) | (wb << 5)) << 41
        out.append(f"        /*{16 * n:04x}*/                   {ins} ;   /* 0x000000000000000 */")
        out.append(f"                                                                  /* 0x{hi:016x} */")
    return "\n".join(out) + "\n"


LDG = "LDG.E.NA.128.CONSTANT R4, desc[UR4][R4.64]"
NONE = 7  # no write scoreboard


def test_decode_reads_the_write_scoreboard_and_wait_mask():
    rows = sass_check.decode(fake_sass([(LDG, 5, 0), ("IMAD R1, R2, R3, R4", NONE, 0b100001)]))
    assert [(r[2], r[3]) for r in rows] == [(5, 0), (NONE, 0b100001)]


def test_a_wait_on_the_load_scoreboard_between_loads_is_flagged():
    bad = fake_sass([(LDG, 5, 0), ("SHF.L.U32 R21, R94, 0x4, RZ", NONE, 1 << 5), (LDG, 5, 0)])
    assert len(sass_check.burst_waits(sass_check.decode(bad))) == 1


def test_waits_on_other_scoreboards_or_after_the_burst_are_not():
    other = fake_sass([(LDG, 5, 0), ("SHF.L.U32 R21, R94, 0x4, RZ", NONE, 1 << 2), (LDG, 5, 0)])
    after = fake_sass(
        [(LDG, 5, 0), (LDG, 5, 0)] + [("FFMA R1, R2, R3, R1", NONE, 0)] * 45 + [("F2FP.F16.E4M3.UNPACK_B R84, R4", NONE, 1 << 5)]
    )
    assert sass_check.burst_waits(sass_check.decode(other)) == []
    assert sass_check.burst_waits(sass_check.decode(after)) == []


def staged(wait_in_staging: tuple[str, int, int]) -> str:
    """Early weight loads, the PDL wait, one staging instruction, the barrier, then the products."""
    return fake_sass(
        [
            (LDG, 5, 0),
            ("ACQBULK", NONE, 0),
            wait_in_staging,
            ("BAR.SYNC.DEFER_BLOCKING 0x0", NONE, 0),
            ("SHF.R.U32.HI R78, RZ, 0x10, R12", NONE, 1 << 5),
            ("HMMA.16816.F32 R80, R80, R76, RZ", NONE, 0),
        ]
    )


def test_a_wait_on_the_weight_loads_while_x_is_staged_is_flagged():
    rows = sass_check.decode(staged(("PRMT R79, R72, 0x7632, R79", NONE, 1 << 5)))
    got = [(addr, ins.strip()) for addr, ins in sass_check.staging_waits(rows)]
    assert got == [(0x20, "PRMT R79, R72, 0x7632, R79")]


def test_staging_waits_on_other_scoreboards_calls_and_the_products_are_not():
    for ins in (("LDS.128 R12, [R11]", NONE, 1 << 2), ("CALL.REL.NOINC 0x9420", NONE, 0x3F)):
        assert sass_check.staging_waits(sass_check.decode(staged(ins))) == []  # the product's wait is after


def test_main_fails_on_a_serialized_kernel(tmp_path, capsys):
    p = tmp_path / "k.sass"
    p.write_text(fake_sass([(LDG, 5, 0), ("SHF.L.U32 R21, R94, 0x4, RZ", NONE, 1 << 5), (LDG, 5, 0)]))
    assert sass_check.main(["--sass", str(p)]) == 1
    assert "1 with serialized weight loads or staging" in capsys.readouterr().out
    p.write_text(staged(("PRMT R79, R72, 0x7632, R79", NONE, 1 << 5)))
    assert sass_check.main(["--sass", str(p)]) == 1
    assert "while x is staged" in capsys.readouterr().out


@pytest.mark.skipif(not (shutil.which("nvcc") and shutil.which("cuobjdump")), reason="needs nvcc and cuobjdump")
def test_the_gemv_kernels_load_their_weights_without_serializing():
    assert sass_check.main([]) == 0


@pytest.mark.skipif(not shutil.which("cuobjdump"), reason="needs cuobjdump")
def test_the_built_extension_modules_pass(capsys):
    """What CMake built (its flags, every GEMV instance of the core and the sandbox) passes too."""
    if not sass_check.built_modules():
        pytest.skip("the CUDA extension modules are not built")
    assert sass_check.main(["--built"]) == 0
    checked = int(capsys.readouterr().out.split("sass_check: ")[1].split()[0])
    # two modules, 33 GEMV kernels each: ten products, each with whole rows, a ragged last step, and a
    # ragged last step ending in a tail scale group, and the QKV product's three with a bias
    assert checked >= 66
