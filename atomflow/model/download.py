"""`atomflow download`: fetch a Hugging Face model into a directory, resumably.

Online, huggingface_hub downloads into the directory (an interrupted download resumes where it
stopped). Offline, or when the Hub cannot be reached, the files come from the local Hugging
Face cache when the model is there. Either way the directory gets `.atomflow-source.json`
(repo id and commit), which the quantizer records in the model file.
"""

from __future__ import annotations

import json
import shutil
from fnmatch import fnmatch
from pathlib import Path

from atomflow.errors import AtomflowError
from atomflow.model.quantize import SOURCE_FILE

# What a Llama checkpoint needs; skips original/*.pth consolidated weights and other formats.
ALLOW_PATTERNS = [
    "config.json",
    "generation_config.json",
    "model*.safetensors",
    "model.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
]


def download(repo_id: str, target: str | Path, revision: str | None = None, token: str | None = None) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    target = Path(target)
    try:
        snapshot_download(repo_id, revision=revision, local_dir=target, allow_patterns=ALLOW_PATTERNS, token=token)
        commit = _local_dir_commit(target)
    except GatedRepoError:
        raise AtomflowError(f"{repo_id} is gated: accept its license on the Hub, then log in or pass --token") from None
    except RepositoryNotFoundError:
        raise AtomflowError(f"{repo_id}: no such repository on the Hub (or it is private: pass --token)") from None
    except RevisionNotFoundError:
        raise AtomflowError(f"{repo_id}: no revision {revision!r}") from None
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError) as e:
        commit = _from_cache(repo_id, revision, target, token, e)
    (target / SOURCE_FILE).write_text(json.dumps(dict(repo_id=repo_id, revision=commit)))
    return target


def _from_cache(repo_id, revision, target: Path, token, online_error) -> str:
    """The Hub is unreachable: copy the model out of the local HF cache, if it is there."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        snap = Path(snapshot_download(repo_id, revision=revision, local_files_only=True, token=token))
    except LocalEntryNotFoundError:
        raise AtomflowError(
            f"cannot download {repo_id}: the Hugging Face Hub is unreachable (offline?) and the "
            f"model is not in the local cache ({type(online_error).__name__})"
        ) from None
    target.mkdir(parents=True, exist_ok=True)
    for f in sorted(snap.iterdir()):
        if f.is_file() and any(fnmatch(f.name, p) for p in ALLOW_PATTERNS):
            tmp = target / (f.name + ".part")
            shutil.copyfile(f, tmp)  # resolves the cache's symlinks into real files
            tmp.replace(target / f.name)
    return snap.name  # cache snapshot folders are named by commit hash


def _local_dir_commit(target: Path) -> str | None:
    """huggingface_hub records the commit of each file it put in a local dir."""
    meta = target / ".cache" / "huggingface" / "download" / "config.json.metadata"
    return meta.read_text().splitlines()[0].strip() if meta.is_file() else None
