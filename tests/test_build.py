"""The built extensions: _core and _sandbox link the same kernels, so neither may export a GNU unique
symbol of ours (a function-local static of a template or inline function with default visibility is
one object per process: a launcher's "attribute set once" flag set by one module would skip the other
module's own kernel, whose launch then fails with too much shared memory). CMakeLists.txt hides every
symbol; this reads what the installed modules export."""

import importlib.util
import shutil
import subprocess

import pytest

MODULES = ("atomflow._core", "atomflow._sandbox")


def unique_symbols_of_ours(nm_output: str) -> list[str]:
    """Names bound GNU unique (nm's 'u') that belong to atomflow, from `nm -D --defined-only` lines."""
    out = []
    for line in nm_output.splitlines():
        parts = line.split(maxsplit=2)
        if len(parts) == 3 and parts[1] == "u" and "atomflow" in parts[2]:
            out.append(parts[2])
    return out


def test_the_filter_finds_a_unique_static():
    nm = (
        "0000000002555250 u _ZGVZN8atomflow7kernels4sm9011run_cutlassIN7cutlass4gemmE8smem_set\n"
        "00000000001d294b u _ZSt19piecewise_construct\n"
        "0000000000066380 T PyInit__core\n"
    )
    assert unique_symbols_of_ours(nm) == ["_ZGVZN8atomflow7kernels4sm9011run_cutlassIN7cutlass4gemmE8smem_set"]


@pytest.mark.parametrize("module", MODULES)
def test_extension_exports_no_unique_symbol_of_ours(module):
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        pytest.skip(f"{module} is not built here")
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("no nm (binutils) to read the module's symbols")
    listing = subprocess.run([nm, "-D", "--defined-only", spec.origin], capture_output=True, text=True, check=True)
    found = unique_symbols_of_ours(listing.stdout)
    assert not found, f"{module} exports {len(found)} GNU unique symbol(s) of ours, e.g. {found[0]}"
