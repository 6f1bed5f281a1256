"""Checks the GEMV's machine code for two compiler behaviours that silently cost it bandwidth: a
wait on the weight loads' scoreboard in the middle of a burst of weight loads, or in the staging of x.

The compiler tracks all of a kernel's weight loads (LDG.E.NA.128) with one scoreboard. If an
instruction between two of those loads waits on it, each load of the burst waits for the previous
one's data: the round trips are serialized (seen: lm_head at 62% of the read ceiling instead of
95%, csrc/kernels/gemv_w8a16.cu). This script compiles the kernel file for sm_90, disassembles it
with cuobjdump, decodes each instruction's wait mask from its control bits, and fails if any
GEMV kernel has such a wait.

The second rule: between the PDL wait (ACQBULK) and the staging's last barrier before the first
tensor-core product, no instruction may wait on the weight loads' scoreboard. Half the warps load
their first weights before the PDL wait; a wait there holds the staging of x, and with it the whole
block, until those loads arrive from DRAM (seen: x loaded into registers with ld.global shared
their scoreboard; it is copied with cp.async since). A CALL is exempt: it waits on every scoreboard
and only leads to a slow path (the division's, for denormal inputs).

With --built it disassembles the installed extension modules instead
(atomflow._core and atomflow._sandbox: the machine code CMake built, with its flags and
architectures, which is what runs); scripts/gpu_check.sh checks those.

    python tools/sass_check.py [--source csrc/kernels/gemv_w8a16.cu | --built | --sass FILE]

Needs nvcc and cuobjdump (CUDA toolkit). Exit 0: clean; 1: waits found; 2: tools missing.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
INSTR = re.compile(r"/\*([0-9a-f]{4,6})\*/\s+(.*?);\s*/\* (0x[0-9a-f]+) \*/")
HI = re.compile(r"/\* (0x[0-9a-f]+) \*/")
WEIGHT_LOAD = "LDG.E.NA.128"
BURST_GAP = 40  # instructions: loads this close together belong to one burst


def decode(fn_text: str) -> list[tuple[int, str, int, int]]:
    """(address, instruction, write scoreboard, wait mask) of each instruction of one function.
    Hopper control bits sit in the top 23 bits of the second 64-bit word: stall [0:4], yield [4],
    write barrier [5:8], read barrier [8:11], wait mask [11:17]."""
    lines, rows = fn_text.splitlines(), []
    for k, line in enumerate(lines[:-1]):
        m = INSTR.search(line)
        hi = HI.search(lines[k + 1]) if m else None
        if not m or not hi:
            continue
        ctrl = int(hi.group(1), 16) >> 41
        rows.append((int(m.group(1), 16), m.group(2), (ctrl >> 5) & 7, (ctrl >> 11) & 0x3F))
    return rows


def burst_waits(rows: list[tuple[int, str, int, int]]) -> list[tuple[int, str]]:
    """Instructions waiting on a weight-load scoreboard between two weight loads of one burst."""
    boards = {wb for _, ins, wb, _ in rows if WEIGHT_LOAD in ins}
    loads = [n for n, (_, ins, _, _) in enumerate(rows) if WEIGHT_LOAD in ins]
    bad = []
    for n, (addr, ins, _, mask) in enumerate(rows):
        if not any(mask >> sb & 1 for sb in boards):
            continue
        before = [i for i in loads if i < n]
        after = [i for i in loads if i > n]
        if before and after and n - before[-1] < BURST_GAP and after[0] - n < BURST_GAP:
            bad.append((addr, ins))
    return bad


def staging_waits(rows: list[tuple[int, str, int, int]]) -> list[tuple[int, str]]:
    """Instructions waiting on a weight-load scoreboard while x is staged: after the PDL wait, up to
    the last barrier before the first tensor-core product (CALLs exempt: module docstring)."""
    boards = {wb for _, ins, wb, _ in rows if WEIGHT_LOAD in ins}
    start = next((n for n, r in enumerate(rows) if r[1].startswith("ACQBULK")), None)
    first_mma = next((n for n, r in enumerate(rows) if r[1].startswith("HMMA")), None)
    if start is None or first_mma is None:
        return []
    bars = [n for n in range(start, first_mma) if rows[n][1].startswith("BAR.SYNC")]
    if not bars:
        return []
    return [
        (addr, ins)
        for addr, ins, _, mask in rows[start : bars[-1]]
        if not ins.startswith("CALL") and any(mask >> sb & 1 for sb in boards)
    ]


def built_modules() -> list[Path]:
    """Files of the installed atomflow._core and atomflow._sandbox (those that import)."""
    import importlib

    found = []
    for name in ("atomflow._core", "atomflow._sandbox"):
        try:
            found.append(Path(importlib.import_module(name).__file__))
        except ImportError:
            pass
    return found


def disassemble(binary: Path) -> str:
    return subprocess.run(["cuobjdump", "-sass", str(binary)], check=True, capture_output=True, text=True).stdout


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--source", default=str(ROOT / "csrc/kernels/gemv_w8a16.cu"))
    ap.add_argument("--sass", help="check this cuobjdump -sass output instead of compiling")
    ap.add_argument("--built", action="store_true", help="check the installed extension modules instead of compiling")
    a = ap.parse_args(argv)
    if a.sass:
        text = Path(a.sass).read_text()
    elif a.built:
        if not shutil.which("cuobjdump"):
            print("sass_check: needs cuobjdump on PATH", file=sys.stderr)
            return 2
        binaries = built_modules()
        if not binaries:
            print("sass_check: atomflow's CUDA extension modules are not installed", file=sys.stderr)
            return 2
        text = "".join(disassemble(b) for b in binaries)
    else:
        if not shutil.which("nvcc") or not shutil.which("cuobjdump"):
            print("sass_check: needs nvcc and cuobjdump on PATH", file=sys.stderr)
            return 2
        with tempfile.TemporaryDirectory() as tmp:
            cubin = Path(tmp) / "k.cubin"
            subprocess.run(
                ["nvcc", "-arch=sm_90", "-std=c++17", f"-I{ROOT / 'include'}", "-cubin", "-o", str(cubin), a.source], check=True
            )
            text = disassemble(cubin)
    failed, checked = 0, 0
    for fn in re.split(r"\n\s*Function : ", text)[1:]:
        name = fn.split("\n", 1)[0].strip()
        if "gemv_w8a16_kernel" not in name:
            continue
        checked += 1
        rows = decode(fn)
        bad, staging = burst_waits(rows), staging_waits(rows)
        if bad:
            print(
                f"sass_check: {name}: {len(bad)} scoreboard wait(s) inside weight-load bursts, first at "
                f"0x{bad[0][0]:x} ({bad[0][1]})"
            )
        if staging:
            print(
                f"sass_check: {name}: {len(staging)} wait(s) on the weight loads while x is staged, first at "
                f"0x{staging[0][0]:x} ({staging[0][1]})"
            )
        failed += bool(bad or staging)
    if not checked:
        print("sass_check: no gemv_w8a16_kernel in the disassembly", file=sys.stderr)
        return 2
    print(f"sass_check: {checked} GEMV kernels, {failed} with serialized weight loads or staging")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
