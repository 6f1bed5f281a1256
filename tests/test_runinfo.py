"""runinfo.commit: what a report says it measured."""

import shutil
import subprocess

import pytest

from atomflow import runinfo


def git(cwd, *args) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_commit_is_the_source_trees_git_head(monkeypatch, tmp_path):
    """A tree of its own: its HEAD, then "-dirty" once a tracked file changes; no repository at all
    gives "unknown"."""
    monkeypatch.delenv("ATOMFLOW_COMMIT", raising=False)
    repo = tmp_path / "tree"
    repo.mkdir()
    git(repo, "init", "-q")
    (repo / "a.txt").write_text("one\n")
    git(repo, "add", "a.txt")
    git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "one")
    monkeypatch.setattr(runinfo, "ROOT", repo)
    head = git(repo, "rev-parse", "--short", "HEAD")
    assert runinfo.commit() == head
    (repo / "a.txt").write_text("two\n")
    assert runinfo.commit() == head + "-dirty"
    (repo / "untracked.txt").write_text("not part of the tree\n")
    git(repo, "checkout", "-q", "a.txt")
    assert runinfo.commit() == head  # untracked files do not make a tree dirty
    bare = tmp_path / "no_repo"
    bare.mkdir()
    monkeypatch.setattr(runinfo, "ROOT", bare)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))
    assert runinfo.commit() == "unknown"


def test_the_environment_names_the_commit_of_a_copied_tree(monkeypatch):
    # A copy of the tree (a GPU machine's) may carry a stale .git or none: the override wins.
    monkeypatch.setenv("ATOMFLOW_COMMIT", "b322060")
    assert runinfo.commit() == "b322060"
