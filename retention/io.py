"""Safe file writing: atomic directories and files, safetensors state dicts."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Iterator

import torch


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _usual_permissions(root: Path) -> None:
    """Temp files and folders are private (0600 / 0700); give what we publish the usual umask modes."""
    mask = _umask()
    for p in [root, *root.rglob("*")] if root.is_dir() else [root]:
        os.chmod(p, (0o777 if p.is_dir() else 0o666) & ~mask)


class FolderBusyError(RuntimeError):
    """Another process is writing to the folder a run would write to; the message names it and the fix."""


class LockFolderError(FolderBusyError):
    """The folder of the locks (in the system's temp folder) is not this user's own, private folder, or holds a
    symbolic link where a lock goes: another local user could block this user's runs or redirect what they write.
    The message names the folder and the fix."""


def lock_folder() -> Path:
    """This user's folder of locks, ``<tmp>/retention-locks-<user>``: created private (0700) when missing, and
    refused (:class:`LockFolderError`) when it is a link, another user's, or writable by others, since in a shared
    temp folder anyone can create that name first."""
    import getpass
    import stat

    locks = Path(tempfile.gettempdir()) / f"retention-locks-{getpass.getuser()}"
    with contextlib.suppress(FileExistsError):
        os.mkdir(locks, 0o700)
    fix = f"remove it (rm -r {locks}) if it is stale, or set TMPDIR to a folder of your own"
    st = os.lstat(locks)
    if not stat.S_ISDIR(st.st_mode):
        raise LockFolderError(f"the lock folder {locks} is not a folder (a link or a file): {fix}")
    if st.st_uid != os.geteuid():
        raise LockFolderError(f"the lock folder {locks} belongs to another user (uid {st.st_uid}): {fix}")
    if st.st_mode & 0o022:  # others could have put links or locks in it
        raise LockFolderError(f"the lock folder {locks} is writable by other users (mode {stat.S_IMODE(st.st_mode):o}, "
                              f"not 700): {fix}")
    if st.st_mode & 0o077:  # readable only (earlier versions made it with the umask's mode): nothing to fear in it
        os.chmod(locks, 0o700)
    return locks


def _refuse_link(path: Path) -> None:
    if path.is_symlink():  # only this user (or root) can write the private folder: not ours to follow or delete
        raise LockFolderError(f"{path} is a symbolic link, where retention keeps a lock: remove it (rm {path})")


@contextlib.contextmanager
def exclusive_use(folder: str | Path, what: str, fix: str = "give this one another output folder") -> Iterator[None]:
    """Hold a lock on ``folder`` while ``what`` (a training run, a sweep) writes there. A second run into the same
    folder would interleave its rows or checkpoints with the first's: it gets :class:`FolderBusyError` at once,
    naming ``fix``. The lock is a file in this user's private :func:`lock_folder`, so it holds between the processes
    of one machine; its files are never written through links."""
    import hashlib

    from filelock import FileLock, Timeout

    # the lock lives in the temp folder (cleared by the system, one per user), keyed by the folder's path: the
    # folder itself is not created or touched
    folder = Path(folder).expanduser().resolve()
    locks = lock_folder()
    key = hashlib.sha1(str(folder).encode()).hexdigest()[:16]
    lock_file, pid_file = locks / f"{key}.lock", locks / f"{key}.pid"
    _refuse_link(lock_file)
    lock = FileLock(str(lock_file))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        try:
            fd = os.open(pid_file, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
            with os.fdopen(fd) as fh:
                holder = f" (pid {int(fh.read())})"
        except (OSError, ValueError):
            holder = ""
        raise FolderBusyError(f"another process{holder} is writing {what} in {folder}: wait for it to finish, or "
                              f"{fix}") from None
    try:
        # a new file (a stale one, or a link put there, is removed first, never followed)
        with contextlib.suppress(FileNotFoundError):
            pid_file.unlink()
        fd = os.open(pid_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(str(os.getpid()))
        yield
    finally:
        with contextlib.suppress(OSError):
            pid_file.unlink()
        lock.release()


def check_replaceable(path: str | Path, ours: Callable[[Path], bool], what: str) -> None:
    """Refuse to replace ``path`` unless it is absent, an empty folder, or ``ours`` (what we write there already).

    :func:`atomic_directory` swaps a whole folder: ``--to ~/work`` would otherwise delete everything in it.
    """
    path = Path(path)
    if not path.exists() or (path.is_dir() and not any(path.iterdir())) or (path.is_dir() and ours(path)):
        return
    if not path.is_dir():
        raise FileExistsError(f"{path} is a file, and {what} is written as a folder; choose a new or empty folder")
    raise FileExistsError(
        f"{path} is a folder that does not hold {what}: writing {what} there replaces the whole folder, which would "
        "delete what is in it; choose a new or empty folder"
    )


@contextlib.contextmanager
def atomic_directory(path: str | Path, keep_existing: bool = False) -> Iterator[Path]:
    """Yield a temporary directory beside ``path``; on success it replaces ``path`` in one rename.

    A crash while writing leaves the previous ``path`` untouched (and a ``.tmp-*`` folder to delete).
    ``keep_existing``: for caches keyed by their content, where every writer makes the same folder: if ``path``
    exists by the time this one is written (another process, e.g. another rank, built it meanwhile), keep it and
    drop this one, so a reader of the first is never pulled from under it.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{path.name}-", dir=path.parent))
    try:
        yield tmp
        _usual_permissions(tmp)
        if keep_existing:
            try:
                os.rename(tmp, path)  # fails when path exists as a non-empty folder: the first writer wins
            except OSError:
                if not path.is_dir():
                    raise
                shutil.rmtree(tmp, ignore_errors=True)
            return
        old = None
        if path.exists():
            # a name no earlier run can hold: a crash between the two renames leaves its .old- folder behind, and a
            # later process of the same pid (common in containers) could not move the folder onto it
            old = path.with_name(f".old-{tmp.name.removeprefix('.tmp-')}")
            os.replace(path, old)
        os.replace(tmp, path)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temp file and a rename."""
    path = Path(path)
    if path.is_dir():  # the rename would fail only after the temp file is written beside the folder
        raise IsADirectoryError(f"{path} is a folder: give the path of a file to write")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".tmp-{path.name}-", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        _usual_permissions(Path(tmp))
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def save_state(state: dict[str, torch.Tensor], path: str | Path, metadata: dict[str, str] | None = None) -> None:
    """Save a state dict as safetensors (contiguous, detached copies)."""
    from safetensors.torch import save_file

    tensors = {k: v.detach().contiguous().cpu() for k, v in state.items()}
    save_file(tensors, str(path), metadata=metadata)
