"""Atomic writes: a folder is replaced in one rename, a crash leaves the old one, and a content-keyed cache
built by two processes at once keeps the first (a reader of it is never pulled from under it)."""

import pytest

from retention.io import atomic_directory


def _leftovers(folder):
    return sorted(p.name for p in folder.iterdir() if p.name.startswith((".tmp-", ".old-")))


def test_a_folder_is_replaced_whole_or_not_at_all(tmp_path):
    target = tmp_path / "ckpt"
    with atomic_directory(target) as tmp:
        (tmp / "a").write_text("one")
    with atomic_directory(target) as tmp:
        (tmp / "a").write_text("two")
    assert (target / "a").read_text() == "two"
    with pytest.raises(RuntimeError, match="crash"):
        with atomic_directory(target) as tmp:
            (tmp / "a").write_text("three")
            raise RuntimeError("crash while writing")
    assert (target / "a").read_text() == "two" and _leftovers(tmp_path) == []


def test_a_cache_built_twice_at_once_keeps_the_first(tmp_path):
    target = tmp_path / "cache-key"
    with atomic_directory(target, keep_existing=True) as mine:
        (mine / "a").write_text("mine")
        with atomic_directory(target, keep_existing=True) as theirs:  # another process finishes first
            (theirs / "a").write_text("theirs")
        first = (target / "a").stat().st_ino
    assert (target / "a").read_text() == "theirs" and (target / "a").stat().st_ino == first
    assert _leftovers(tmp_path) == []
    with atomic_directory(target) as tmp:  # without keep_existing a rewrite still replaces it
        (tmp / "a").write_text("rewritten")
    assert (target / "a").read_text() == "rewritten"
