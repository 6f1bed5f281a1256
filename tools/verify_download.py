"""Check a downloaded Hugging Face model against the Hub's LFS sha256 and write SHA256SUMS.

    python tools/verify_download.py DIR REPO_ID [--revision REV] [--token TOKEN]

Online: HfApi().model_info(repo, revision, files_metadata=True) lists each LFS file's sha256
(the weights); every local file that has one must hash to it, or the exit code is 1 and the
mismatches are named. Offline (or the Hub does not answer): the check is skipped with a note.
Either way DIR/SHA256SUMS is written (sha256sum format, every top-level file), so
`sha256sum -c SHA256SUMS` re-checks the copy later. The revision defaults to the commit that
`atomflow download` recorded in DIR/.atomflow-source.json, so the metadata matches the files.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

SUMS = "SHA256SUMS"


def local_sha256(path: Path, chunk: int = 16 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def model_files(d: Path) -> list[Path]:
    """Top-level regular files, not hidden, not SHA256SUMS itself."""
    return sorted(p for p in d.iterdir() if p.is_file() and not p.name.startswith(".") and p.name != SUMS)


def hub_sha256(repo_id: str, revision: str | None, token: str | None = None) -> tuple[dict[str, str] | None, str]:
    """({filename: sha256} of the LFS files, "") or (None, why the Hub gave no answer)."""
    try:
        from huggingface_hub import HfApi

        info = HfApi().model_info(repo_id, revision=revision, files_metadata=True, token=token)
    except Exception as e:  # noqa: BLE001 - offline, unreachable, gated: all mean "cannot check"
        return None, f"{type(e).__name__}: {str(e).strip().splitlines()[0][:160] if str(e).strip() else ''}"
    out = {}
    for s in info.siblings or []:
        lfs = getattr(s, "lfs", None)
        sha = getattr(lfs, "sha256", None) if lfs is not None else None
        if sha is None and isinstance(lfs, dict):
            sha = lfs.get("sha256")
        if sha:
            out[s.rfilename] = sha
    return out, ""


def verify(d: Path, expected: dict[str, str]) -> tuple[list[str], int]:
    """(mismatching or missing files, files checked) for the expected files present in the
    download's allow-list (a file the Hub lists but we did not fetch is not an error)."""
    bad, checked = [], 0
    local = {p.name: p for p in model_files(d)}
    for name, sha in sorted(expected.items()):
        if name not in local:
            continue
        checked += 1
        if local_sha256(local[name]) != sha:
            bad.append(name)
    return bad, checked


def write_sums(d: Path) -> Path:
    out = d / SUMS
    out.write_text("".join(f"{local_sha256(p)}  {p.name}\n" for p in model_files(d)))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("repo_id")
    ap.add_argument("--revision", default=None)
    ap.add_argument("--token", default=None)
    a = ap.parse_args(argv)
    d = Path(a.dir)
    revision = a.revision
    src = d / ".atomflow-source.json"
    if revision is None and src.is_file():
        revision = json.loads(src.read_text()).get("revision")
    expected, why = hub_sha256(a.repo_id, revision, a.token)
    rc = 0
    if expected is None:
        print(f"verify: sha256 check skipped: no Hub metadata for {a.repo_id} ({why}); offline?")
    else:
        bad, checked = verify(d, expected)
        if bad:
            print(f"verify: sha256 MISMATCH for {', '.join(bad)}: delete them and download again", file=sys.stderr)
            rc = 1
        else:
            print(f"verify: {checked} LFS files match the Hub's sha256 ({a.repo_id} @ {revision or 'main'})")
    print(f"verify: wrote {write_sums(d)}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
