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

Reading is the other half: ``read_bounded`` (and ``load_json_bounded``) reads a run file that
anyone may have replaced (a FIFO, a link to /dev/zero, a huge or deeply nested file) without
blocking, without reading without end, and failing with one OSError or ValueError, so such a
file is a damaged file for its reader, never a hung resume or CLI verb.
"""

from __future__ import annotations

import contextlib
import errno
import os
import json
import re
import secrets
import stat
from typing import Any, Callable

__all__ = ["write_atomic", "fsync_dir", "temp_name", "temp_target", "read_bounded",
           "read_bounded_stat", "open_regular", "file_kind",
           "load_json_bounded", "parse_json", "NotARegularFile", "TooLarge", "SMALL_FILE_MAX"]

# The cap for the run's small files (manifest, marker, run.json, the lease, bad-nodes.json, the
# restart record): the largest of ours, a manifest of a many-rank checkpoint listing every
# record, stays far below it; /dev/zero or a file someone grew by mistake does not.
SMALL_FILE_MAX = 64 << 20

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
                 exclusive: bool = False, durable: bool = True, mode: int = 0o666,
                 before_rename: Callable[[], None] | None = None) -> bool:
    """Put ``data`` (``str`` is written as UTF-8) in ``path`` whole; see the module docstring.

    ``exclusive``: create the file only if it does not exist (hard link); returns False, writing
    nothing, when it does. Otherwise the file is replaced, and the result is always True.
    ``durable=False``: no fsync of the file nor of the directory. ``mode`` is given to
    ``open`` (the umask applies). ``before_rename`` runs once the temporary file is written,
    right before it is put in place (a commit's last check, the lease's): when it raises, the
    temporary file is removed and the target untouched. Raises OSError when the file cannot be
    written; the directory must exist."""
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
        if before_rename is not None:
            before_rename()
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


# ------------------------------------------------------------------------------ reading

class NotARegularFile(OSError):
    """A run file that is a FIFO, a device, a directory or a socket (or, where symlinks are
    refused, a symlink): reading it could block forever or never end."""


class TooLarge(OSError):
    """A run file larger than its reader's cap: none of ours ever is."""


def read_bounded(path: str | os.PathLike[str], max_bytes: int = SMALL_FILE_MAX, *,
                 follow_symlinks: bool = True) -> bytes:
    """The whole of the regular file ``path``, bounded in size and never blocking on what is not
    a regular file. Every read of a run file (manifest, marker, run.json, the lease, the
    ledger, bad-nodes.json) goes through here, so a hostile or odd file fails one read instead
    of hanging a resume or a CLI verb:

    * opened with ``O_NONBLOCK`` (a FIFO's open returns at once instead of waiting for a
      writer), and ``O_NOFOLLOW`` unless ``follow_symlinks`` (a file we only ever create
      ourselves, never a link: the lease);
    * ``fstat`` on the open descriptor (no race with a rename): anything but a regular file
      raises ``NotARegularFile``, so a symlink to /dev/zero or a FIFO is refused, not read;
    * at most ``max_bytes`` are read: a larger file raises ``TooLarge`` (also one that grows
      while read).

    Raises FileNotFoundError when the file is absent, and OSError for every other problem."""
    return read_bounded_stat(path, max_bytes, follow_symlinks=follow_symlinks)[0]


def read_bounded_stat(path: str | os.PathLike[str], max_bytes: int = SMALL_FILE_MAX, *,
                      follow_symlinks: bool = True) -> tuple[bytes, os.stat_result]:
    """``read_bounded``, and the ``fstat`` of the file it read (its mtime and inode, taken on
    the same open descriptor: the lease judges a holder by them)."""
    fd = open_regular(path, follow_symlinks=follow_symlinks)
    try:
        st = os.fstat(fd)
        if st.st_size > max_bytes:
            raise TooLarge(errno.EFBIG, f"{st.st_size} bytes, more than the {max_bytes} a file "
                           "of this kind may hold", os.fspath(path))
        chunks, total = [], 0
        while True:
            b = os.read(fd, min(1 << 20, max_bytes + 1 - total))
            if not b:
                return b"".join(chunks), st
            chunks.append(b)
            total += len(b)
            if total > max_bytes:
                raise TooLarge(errno.EFBIG, f"more than the {max_bytes} bytes a file of this "
                               "kind may hold (it grew while read)", os.fspath(path))
    finally:
        os.close(fd)


def open_regular(path: str | os.PathLike[str], *, follow_symlinks: bool = True) -> int:
    """A read-only descriptor of the regular file ``path`` (``O_NONBLOCK``: the open of a FIFO
    returns at once; ``O_NOFOLLOW`` unless ``follow_symlinks``), or ``NotARegularFile`` for
    anything else, judged by ``fstat`` on the descriptor itself. For files read in full by
    their own loop (a checkpoint's data files, ``.metadata``); small files: ``read_bounded``."""
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow_symlinks else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags)
    except OSError as e:
        if e.errno == errno.ELOOP and not follow_symlinks:
            raise NotARegularFile(errno.ELOOP, "a symbolic link, not a regular file",
                                  os.fspath(path)) from None
        raise
    try:
        mode = os.fstat(fd).st_mode
    except BaseException:
        os.close(fd)
        raise
    if not stat.S_ISREG(mode):
        os.close(fd)
        if stat.S_ISDIR(mode):       # in the words the OS uses for it elsewhere
            raise NotARegularFile(errno.EISDIR, "Is a directory, not a regular file",
                                  os.fspath(path))
        raise NotARegularFile(errno.EINVAL, f"not a regular file ({file_kind(mode)})",
                              os.fspath(path))
    return fd


def load_json_bounded(path: str | os.PathLike[str], max_bytes: int = SMALL_FILE_MAX, *,
                      follow_symlinks: bool = True) -> Any:
    """``read_bounded`` then ``json.loads``. Bytes that are not JSON raise ValueError, whatever
    the parser raised: a document nested too deep (``[[[[...``, RecursionError) included, so a
    caller's one ``except ValueError`` covers every way the contents can be wrong."""
    return parse_json(read_bounded(path, max_bytes, follow_symlinks=follow_symlinks))


def parse_json(raw: bytes | str) -> Any:
    """``json.loads`` whose every failure on bad bytes is a ValueError (see
    ``load_json_bounded``)."""
    try:
        return json.loads(raw)
    except RecursionError:
        raise ValueError("nested too deep to be one of our files") from None
    except (ValueError, TypeError) as e:       # UnicodeDecodeError is a ValueError
        raise ValueError(str(e)) from None


def file_kind(mode: int) -> str:
    """What a file that is not a regular one is, for a message ("a FIFO", "a symbolic link")."""
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISDIR, "a directory"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISLNK, "a symbolic link")):
        if test(mode):
            return name
    return "not a file"
