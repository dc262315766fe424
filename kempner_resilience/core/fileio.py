"""Small files written whole: a reader sees the old file or the new one, never part of one.

Every small file the package writes in place of another, or as the one copy that must exist (a
checkpoint's manifest and ownership marker, ``run.json``, the restart record, the compacted run
ledger, the run report, the rescue's coordination files, a submitit task's config), goes through
``write_atomic``:

1. the bytes go to a temporary file in the target's own directory (a rename is atomic only
   within one filesystem) named ``.<name>.tmp.<pid>.<random>``: hidden, created with
   ``O_EXCL`` so that no two writers (processes or threads) ever share one, and recognisable
   (``temp_target``) so that retention knows it as ours;
2. the file is fsynced, so the name never points at bytes the disk does not hold yet;
3. it is renamed over the target, or, with ``exclusive``, hard-linked to it: the link fails
   when the target exists, so of two racers exactly one file survives, whole, the first one's
   (filesystems without hard links fall back to ``O_CREAT|O_EXCL`` on the target, written
   after: briefly empty, never a second file);
4. the directory is fsynced: a file's fsync does not cover its name.

When anything fails (a full disk, an exception, a signal's exception) the temporary file is
removed and the target is untouched; only SIGKILL or a crash mid-write can leave a temporary
file behind, never a partial target. ``durable=False`` leaves out both fsyncs (about 15 ms on a
local disk), for files that other processes must see whole but that need not survive a crash of
the machine: the rescue's files (a snapshot is the size of a rank's state), the run report, a
submitit task's config.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import secrets

__all__ = ["write_atomic", "fsync_dir", "temp_name", "temp_target"]

# Errors of os.link on a filesystem without hard links (some FUSE and object-store mounts).
_NO_LINKS = (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK)
_TEMP_RE = re.compile(r"^\.(.+)\.tmp\.\d+\.[0-9a-f]{8}$")


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Make renames/creations inside ``path`` durable (a file's fsync does not cover its name)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temp_name(target: str) -> str:
    """A fresh temporary name for the file name ``target``: ``.<target>.tmp.<pid>.<random>``."""
    return f".{target}.tmp.{os.getpid()}.{secrets.token_hex(4)}"


def temp_target(name: str) -> str | None:
    """The target's name when ``name`` is one of ``write_atomic``'s temporary files, else None."""
    m = _TEMP_RE.match(name)
    return m.group(1) if m else None


def _write_all(fd: int, data: memoryview, durable: bool) -> None:
    view = data.cast("B") if data.format != "B" or data.ndim != 1 else data
    while view:
        view = view[os.write(fd, view):]
    if durable:
        os.fsync(fd)


def _create_temp(directory: str, target: str, mode: int) -> tuple[str, int]:
    while True:
        tmp = os.path.join(directory, temp_name(target))
        try:
            return tmp, os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
        except FileExistsError:  # 32 random bits taken: only a leftover of a reused pid
            continue


def write_atomic(path: str | os.PathLike[str], data: bytes | bytearray | memoryview | str, *,
                 exclusive: bool = False, durable: bool = True, mode: int = 0o666) -> bool:
    """Put ``data`` (``str`` is written as UTF-8) in ``path`` whole; see the module docstring.

    ``exclusive``: create the file only if it does not exist (hard link); returns False, writing
    nothing, when it does. Otherwise the file is replaced, and the result is always True.
    ``durable=False``: no fsync of the file nor of the directory. ``mode`` is given to
    ``open`` (the umask applies). Raises OSError when the file cannot be written; the
    directory must exist."""
    path = os.fspath(path)
    payload = memoryview(data.encode() if isinstance(data, str) else data)  # never a copy
    directory, target = os.path.split(path)
    directory = directory or "."
    tmp, fd = _create_temp(directory, target, mode)
    renamed = False
    try:
        try:
            _write_all(fd, payload, durable)
        finally:
            os.close(fd)
        if not exclusive:
            os.replace(tmp, path)
            renamed = True
        elif not _link_or_create(tmp, path, payload, durable, mode):
            return False
    finally:
        if not renamed:  # a link leaves the temporary name behind, and so does a failure
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
    if durable:
        fsync_dir(directory)
    return True


def _link_or_create(tmp: str, path: str, payload: memoryview, durable: bool, mode: int) -> bool:
    """Hard-link ``tmp`` to ``path``; False when ``path`` exists already."""
    try:
        os.link(tmp, path)
        return True
    except FileExistsError:
        return False
    except OSError as e:
        if e.errno not in _NO_LINKS:
            raise
    # No hard links on this filesystem: O_CREAT|O_EXCL on the target, written after (briefly
    # empty, but still only one file).
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
    except FileExistsError:
        return False
    try:
        _write_all(fd, payload, durable)
    finally:
        os.close(fd)
    return True
