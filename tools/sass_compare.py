"""Whether two builds of one kernel file compile to the same machine code, kernel by kernel.

    nvcc -O3 -arch=sm_90 -std=c++17 --expt-relaxed-constexpr -Iinclude -cubin -o OLD.cubin csrc/kernels/F.cu  # in each tree
    python3 tools/sass_compare.py OLD.cubin NEW.cubin [--map OLD_SUBSTRING=NEW_SUBSTRING ...]

Each kernel is an ELF section `.text.<mangled name>`; its bytes are its instructions. Kernels are
matched by name after the --map substitutions are applied to the old names (for template parameters
a change added, e.g. --map 'EEEvNS0_7Product=ELb0EEEvNS0_7Product'). Prints `same`, `DIFF` or
`NOMATCH` with both instruction counts per old kernel; exit 1 unless every old kernel is `same`.
Needs binutils' readelf, not the CUDA disassemblers."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys

SECTION = re.compile(r"\]\s+(\.text\.\S+)\s+\S+\s+\S+\s+([0-9a-f]+)\s+([0-9a-f]+)")


def kernels(cubin: str) -> dict[str, bytes]:
    table = subprocess.run(["readelf", "-S", "-W", cubin], capture_output=True, text=True, check=True).stdout
    data = open(cubin, "rb").read()
    out = {}
    for m in SECTION.finditer(table):
        off, size = int(m.group(2), 16), int(m.group(3), 16)
        out[m.group(1)] = data[off : off + size]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("--map", action="append", default=[], metavar="OLD=NEW", help="rename in old kernel names")
    a = ap.parse_args(argv)
    old, new = kernels(a.old), kernels(a.new)
    maps = [m.split("=", 1) for m in a.map]
    same = 0
    for name, code in sorted(old.items()):
        twin = name
        for o, n in maps:
            twin = twin.replace(o, n)
        status = "NOMATCH" if twin not in new else ("same" if new[twin] == code else "DIFF")
        same += status == "same"
        print(f"{status:<8} {len(code) // 16:>6} {len(new.get(twin, b'')) // 16:>6}  {name[len('.text.') :]}")
    print(f"{same} of {len(old)} kernels the same")
    return 0 if same == len(old) else 1


if __name__ == "__main__":
    sys.exit(main())
