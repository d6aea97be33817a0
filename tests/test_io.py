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


def test_a_crashed_runs_old_folder_does_not_block_a_later_write_of_the_same_pid(tmp_path):
    """A crash between the two renames leaves the previous folder as .old-NAME-PID; a later process of the same pid
    (containers reuse pids) could not move its folder onto that name, so every later write failed."""
    import os

    target = tmp_path / "ckpt"
    with atomic_directory(target) as tmp:
        (tmp / "a").write_text("one")
    stale = tmp_path / f".old-ckpt-{os.getpid()}"  # what the crashed run of this pid left, still holding files
    stale.mkdir()
    (stale / "a").write_text("crashed run's")
    with atomic_directory(target) as tmp:
        (tmp / "a").write_text("two")
    assert (target / "a").read_text() == "two" and (stale / "a").read_text() == "crashed run's"
    assert _leftovers(tmp_path) == [stale.name]


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


def test_a_folder_in_use_is_refused_to_a_second_writer(tmp_path):
    """Two runs into one output folder interleaved their rows and checkpoints; the second now stops at once, naming
    the first's pid, and the folder is neither created nor touched by the lock."""
    import os
    import subprocess
    import sys

    from retention.io import FolderBusyError, exclusive_use

    folder = tmp_path / "run"
    with exclusive_use(folder, "a sweep"):
        assert not folder.exists()
        with pytest.raises(FolderBusyError, match=f"another process \\(pid {os.getpid()}\\) is writing a sweep in"):
            with exclusive_use(tmp_path / "." / "run", "a sweep"):  # the same folder, spelled otherwise
                pass
        other = subprocess.run(
            [sys.executable, "-c", "import sys; from retention.io import exclusive_use\n"
             f"with exclusive_use({str(folder)!r}, 'a training run'): pass"],
            capture_output=True, text=True, timeout=120)
        assert other.returncode != 0 and "FolderBusyError" in other.stderr and f"pid {os.getpid()}" in other.stderr
    with exclusive_use(folder, "a sweep"):  # released: free again
        pass


def test_the_lock_folder_is_private_and_its_files_are_never_written_through_links(tmp_path, monkeypatch):
    """Issue 77: the lock folder in the shared temp folder was taken as found (anyone can create that name first) and
    the pid file was written through links: another local user could make a run overwrite any file the user can
    write, or block the user's runs. The folder is made 0700 and refused when it is a link, another user's or
    writable by others; a link planted where a lock goes is refused or replaced, never followed."""
    import getpass
    import hashlib
    import os
    import tempfile

    from retention.io import LockFolderError, exclusive_use, lock_folder

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    locks = tmp_path / f"retention-locks-{getpass.getuser()}"
    with exclusive_use(tmp_path / "run", "a sweep"):
        assert oct(locks.stat().st_mode & 0o777) == "0o700"
    victim = tmp_path / "precious.txt"
    victim.write_text("keep me")
    key = hashlib.sha1(str((tmp_path / "run").resolve()).encode()).hexdigest()[:16]
    (locks / f"{key}.pid").symlink_to(victim)  # the pid file is a new file: the link goes, its target stays
    with exclusive_use(tmp_path / "run", "a sweep"):
        assert not (locks / f"{key}.pid").is_symlink()
    assert victim.read_text() == "keep me"
    (locks / f"{key}.lock").unlink(missing_ok=True)
    (locks / f"{key}.lock").symlink_to(victim)
    with pytest.raises(LockFolderError, match=f"{key}.lock is a symbolic link, where retention keeps a lock: remove"):
        with exclusive_use(tmp_path / "run", "a sweep"):
            pass
    assert victim.read_text() == "keep me"
    (locks / f"{key}.lock").unlink()
    locks.chmod(0o777)  # made by someone else, open to all
    with pytest.raises(LockFolderError, match="is writable by other users \\(mode 777, not 700\\): .*set TMPDIR"):
        with exclusive_use(tmp_path / "run", "a sweep"):
            pass
    locks.chmod(0o755)  # what earlier versions made (the umask's mode): ours, and tightened
    assert lock_folder() == locks and oct(locks.stat().st_mode & 0o777) == "0o700"
    monkeypatch.setattr(os, "geteuid", lambda: os.getuid() + 4242)  # as seen by another user
    with pytest.raises(LockFolderError, match=f"{locks} belongs to another user \\(uid {os.getuid()}\\)"):
        lock_folder()
    monkeypatch.undo()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    locks.chmod(0o700)
    locks.rename(tmp_path / "elsewhere")
    locks.symlink_to(tmp_path / "elsewhere")  # a link to a folder someone chose
    with pytest.raises(LockFolderError, match="is not a folder \\(a link or a file\\)"):
        lock_folder()


def test_a_file_write_aimed_at_a_folder_names_it_and_leaves_no_temp_file(tmp_path):
    """The rename used to fail only after the temp file was written beside the folder, with an error naming both."""
    from retention.io import atomic_write_bytes

    target = tmp_path / "out"
    target.mkdir()
    with pytest.raises(IsADirectoryError, match="out is a folder: give the path of a file to write"):
        atomic_write_bytes(target, b"data")
    assert [p.name for p in tmp_path.iterdir()] == ["out"] and not any(target.iterdir())
    atomic_write_bytes(target / "f.json", b"data")
    assert (target / "f.json").read_bytes() == b"data"
