"""runinfo.commit: what a report says it measured."""
import re

from atomflow import runinfo


def test_commit_is_the_source_trees_git_head(monkeypatch):
    monkeypatch.delenv("ATOMFLOW_COMMIT", raising=False)
    assert re.fullmatch(r"[0-9a-f]{7,}(-dirty)?|unknown", runinfo.commit())


def test_the_environment_names_the_commit_of_a_copied_tree(monkeypatch):
    # A copy of the tree (a GPU machine's) may carry a stale .git or none: the override wins.
    monkeypatch.setenv("ATOMFLOW_COMMIT", "b322060")
    assert runinfo.commit() == "b322060"
