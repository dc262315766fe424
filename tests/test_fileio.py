"""A small file written with ``fileio.write_atomic`` is whole or absent, never part of one: the
write fails for real (the kernel's file size limit, as a full disk would), processes are killed
mid-write, and writers race on one name. A run file read with ``fileio.read_bounded`` never
blocks nor reads without end."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from helpers import env, write_script
from kempner_resilience.checkpoint import layout
from kempner_resilience.core.fileio import (NotARegularFile, TooLarge, load_json_bounded,
                                            read_bounded, temp_name, temp_target, write_atomic)

SIZE = 1 << 20

# Writes versions 1, 2, 3, ... of one file, each SIZE bytes of the version's number, until killed.
WRITER = """
import sys
from kempner_resilience.core.fileio import write_atomic
target, exclusive = sys.argv[1], sys.argv[2] == "1"
version = 0
while True:
    version += 1
    if not write_atomic(target, bytes([version % 256]) * SIZE, exclusive=exclusive):
        sys.exit(3)
    print(version, flush=True)
    if exclusive:
        sys.exit(0)
""".replace("SIZE", str(SIZE))

# Write 3 MiB under a file size limit of 4 KiB: the kernel fails the write (EFBIG) partway.
LIMITED = """
import errno, resource, signal, sys
from kempner_resilience.core.fileio import write_atomic
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)      # EFBIG instead of being killed
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
try:
    write_atomic(sys.argv[1], b"new" * (1 << 20))
except OSError as e:
    print(errno.errorcode[e.errno])
"""


def _leftovers(directory) -> list[str]:
    return sorted(n for n in os.listdir(directory) if temp_target(n) is not None)


def _whole(data: bytes) -> bool:
    return len(data) == SIZE and data == data[:1] * SIZE


def test_a_write_that_fails_partway_leaves_the_old_file_and_no_temporary_file(tmp_path):
    target = tmp_path / "run.json"
    target.write_bytes(b"old")
    script = write_script(tmp_path, LIMITED)
    proc = subprocess.run([sys.executable, str(script), str(target)], env=env(),
                          capture_output=True, text=True, timeout=60)
    assert proc.stdout.strip() == "EFBIG", proc.stderr
    assert target.read_bytes() == b"old"
    assert _leftovers(tmp_path) == []


def test_a_writer_killed_mid_write_never_leaves_a_partial_file(tmp_path):
    target = tmp_path / "record.json"
    script = write_script(tmp_path, WRITER)
    for delay in (0.0, 0.01, 0.03, 0.07):
        proc = subprocess.Popen([sys.executable, str(script), str(target), "0"], env=env(),
                                stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline()                 # version 1 is in place
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        proc.stdout.close()
        assert _whole(target.read_bytes())
        # What a kill may leave is a hidden temporary file that says whose it is.
        assert {temp_target(n) for n in _leftovers(tmp_path)} <= {"record.json"}


def test_concurrent_writers_end_with_one_whole_file_and_no_temporary_files(tmp_path):
    target = tmp_path / "report.json"
    errors: list[BaseException] = []

    def write(value: int) -> None:
        try:
            for _ in range(5):
                write_atomic(target, bytes([value]) * SIZE)
        except BaseException as e:  # noqa: BLE001 - reported by the assert below
            errors.append(e)

    threads = [threading.Thread(target=write, args=(v,)) for v in range(1, 9)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert errors == []
    assert _whole(target.read_bytes())
    assert _leftovers(tmp_path) == []


def test_of_processes_racing_to_create_a_file_exactly_one_wins_and_its_file_is_whole(tmp_path):
    target = tmp_path / "claim"
    script = write_script(tmp_path, WRITER)
    procs = [subprocess.Popen([sys.executable, str(script), str(target), "1"], env=env(),
                              stdout=subprocess.DEVNULL) for _ in range(4)]
    codes = sorted(p.wait(timeout=60) for p in procs)
    assert codes == [0, 3, 3, 3]                  # one created it; three found it there
    assert _whole(target.read_bytes())
    assert _leftovers(tmp_path) == []


def test_create_only_if_absent_never_replaces_an_existing_file(tmp_path):
    target = tmp_path / "run.json"
    assert write_atomic(target, "first", exclusive=True) is True
    assert write_atomic(target, "second", exclusive=True) is False
    assert target.read_text() == "first"
    assert _leftovers(tmp_path) == []


def test_retention_counts_a_killed_commits_temporary_manifest_as_ours():
    # A commit killed mid-write leaves `.MANIFEST.json.tmp.<pid>.<random>` in its step
    # directory: retention must still recognise the directory as a partial save of ours.
    assert layout.is_our_file(temp_name(layout.MANIFEST_NAME))
    assert layout.is_our_file(temp_name(layout.MARKER_NAME))
    assert not layout.is_our_file(".notes.txt.tmp.1.0123abcd")


def test_read_bounded_refuses_a_fifo_a_device_and_an_oversized_file_without_blocking(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)                                  # no writer: a plain open would block
    zero = tmp_path / "zero"
    os.symlink("/dev/zero", zero)                    # a plain read would never end
    big = tmp_path / "big"
    big.write_bytes(b"x" * 1001)
    for path in (fifo, zero):
        with pytest.raises(NotARegularFile):
            read_bounded(path)
    with pytest.raises(TooLarge):
        read_bounded(big, max_bytes=1000)
    assert read_bounded(big, max_bytes=1001) == b"x" * 1001
    link = tmp_path / "link"
    os.symlink(big, link)                            # a link to a regular file still reads
    assert read_bounded(link, max_bytes=1001) == b"x" * 1001
    with pytest.raises(NotARegularFile):
        read_bounded(link, max_bytes=1001, follow_symlinks=False)


def test_json_nested_too_deep_is_a_value_error_not_a_recursion_error(tmp_path):
    path = tmp_path / "deep.json"
    path.write_bytes(b"[" * 200_000)
    with pytest.raises(ValueError, match="nested too deep"):
        load_json_bounded(path)
