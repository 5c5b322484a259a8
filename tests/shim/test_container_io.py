"""Container IO: the CRI log format (records, partial lines, reopen after rotation), and the exit reported once, after the drain."""

import asyncio
import os
import re
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import structlog

from backends.contract import ExitInfo, ExitLatch, Output, ProcessPipe
from shim.cri.container_io import MAX_RECORD, ContainerIO, CriLogWriter, parse_rfc3339_nano, rfc3339_nano
from tests.follow import MemoryLog

RECORD = re.compile(rb"^(\S+) (stdout|stderr) ([PF]) (.*)$")


def read(path: str) -> list[tuple[bytes, bytes, bytes]]:
    with open(path, "rb") as f:
        out = []
        for line in f.read().splitlines():
            m = RECORD.match(line)
            assert m, line
            out.append((m.group(2), m.group(3), m.group(4)))
        return out


def test_timestamp_format() -> None:
    assert rfc3339_nano(1_700_000_000_123_456_789) == b"2023-11-14T22:13:20.123456789Z"


def test_lines_and_partials(tmp_path: object) -> None:
    path = os.path.join(str(tmp_path), "a", "c.log")
    w = CriLogWriter(path)
    w.write("stdout", b"hel")
    w.write("stdout", b"lo\nwor")
    w.write("stderr", b"err\n")
    w.write("stdout", b"ld\n")
    w.write("stdout", b"x" * (MAX_RECORD * 2 + 5) + b"\n")
    w.write("stdout", b"tail without newline")
    w.close()
    recs = read(path)
    assert recs[:3] == [(b"stdout", b"F", b"hello"), (b"stderr", b"F", b"err"), (b"stdout", b"F", b"world")]
    assert [r[1] for r in recs[3:6]] == [b"P", b"P", b"F"]
    assert b"".join(r[2] for r in recs[3:6]) == b"x" * (MAX_RECORD * 2 + 5)
    assert recs[6] == (b"stdout", b"P", b"tail without newline")


def test_reopen_after_rotation(tmp_path: object) -> None:
    path = os.path.join(str(tmp_path), "c.log")
    w = CriLogWriter(path)
    w.write("stdout", b"one\n")
    os.rename(path, path + ".1")
    w.write("stdout", b"two\n")  # still goes to the renamed file
    w.reopen()
    w.write("stdout", b"three\n")
    w.close()
    assert [r[2] for r in read(path + ".1")] == [b"one", b"two"]
    assert [r[2] for r in read(path)] == [b"three"]


def test_records_carry_the_time_given(tmp_path: object) -> None:
    path = os.path.join(str(tmp_path), "c.log")
    w = CriLogWriter(path, clock_ns=lambda: 2_000_000_000_000_000_000)
    w.write("stdout", b"from the runtime\n", at=1_700_000_000_123_456_789)
    w.write("stderr", b"no time given\n")
    w.close()
    with open(path, "rb") as f:
        stamps = [line.split(b" ", 1)[0] for line in f.read().splitlines()]
    assert stamps == [rfc3339_nano(1_700_000_000_123_456_789), rfc3339_nano(2_000_000_000_000_000_000)]
    assert [parse_rfc3339_nano(s) for s in stamps] == [1_700_000_000_123_456_789, 2_000_000_000_000_000_000]


# ---------------------------------------------------------------------- following a process


class SlowOutput:
    """A pulled process (not a pipe) whose output trails its exit, as an engine's log stream does."""

    def __init__(self, lines: list[bytes], lag: float) -> None:
        self.exit = ExitLatch()
        self._lines = lines
        self._lag = lag
        self.finished = False

    async def output(self) -> AsyncIterator[Output]:
        await self.exit.wait()
        for line in self._lines:
            await asyncio.sleep(self._lag)
            yield Output("stdout", line)
        self.finished = True


class Exits:
    def __init__(self, log: MemoryLog) -> None:
        self.log = log
        self.seen: list[tuple[str, ExitInfo, bytes]] = []

    def __call__(self, cid: str, info: ExitInfo) -> None:
        # What the log holds at the moment the exit is recorded.
        self.seen.append((cid, info, bytes(self.log.data["stdout"])))


async def test_an_exit_is_reported_once_after_the_output_is_in() -> None:
    log = MemoryLog()
    exits = Exits(log)
    io = ContainerIO(exits)
    proc = SlowOutput([b"a\n", b"b\n", b"c\n"], lag=0.02)
    io.follow("c1", proc, log)
    info = ExitInfo(exit_code=3, finished_at=1)
    proc.exit.set(info)
    proc.exit.set(ExitInfo(exit_code=9, finished_at=2))  # a second report of it changes nothing
    for _ in range(100):
        if exits.seen:
            break
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.05)
    assert exits.seen == [("c1", info, b"a\nb\nc\n")]


async def test_output_that_never_ends_delays_the_exit_a_bounded_time() -> None:
    log = MemoryLog()
    exits = Exits(log)
    io = ContainerIO(exits, drain_wait=0.1)
    pipe = ProcessPipe()
    io.follow("c1", pipe, log)
    pipe.put("stdout", b"partial")
    pipe.exit.set(ExitInfo(exit_code=0, finished_at=1))
    await asyncio.sleep(0.03)
    assert exits.seen == []  # still waiting for the rest
    await asyncio.sleep(0.15)
    assert [(cid, info.exit_code) for cid, info, _ in exits.seen] == [("c1", 0)]


class LateOutput(SlowOutput):
    """An engine under load: nothing for a while after the exit, then the last lines."""

    def __init__(self, lines: list[bytes], silence: float, ends: bool) -> None:
        super().__init__(lines, lag=0)
        self.silence = silence
        self.output_ends = ends

    async def output(self) -> AsyncIterator[Output]:
        await self.exit.wait()
        await asyncio.sleep(self.silence)
        for line in self._lines:
            yield Output("stdout", line)
        self.finished = True


@pytest.mark.parametrize("ends", [True, False])
async def test_silence_after_the_exit_is_not_the_end_of_an_output_sure_to_end(ends: bool) -> None:
    """A process whose output is sure to end (an engine's log read) is waited for through a
    silence longer than DRAIN_WAIT; any other is reported once silent for DRAIN_WAIT."""
    log = MemoryLog()
    exits = Exits(log)
    io = ContainerIO(exits, drain_wait=0.05)
    proc = LateOutput([b"DONE"], silence=0.3, ends=ends)
    io.follow("c1", proc, log)
    proc.exit.set(ExitInfo(exit_code=1, finished_at=1))
    for _ in range(100):
        if exits.seen:
            break
        await asyncio.sleep(0.01)
    assert [(cid, logged) for cid, _, logged in exits.seen] == [("c1", b"DONE" if ends else b"")]
    drained = ContainerIO(Exits(MemoryLog()), drain_wait=0.05)
    late = LateOutput([b"x\n"], silence=0.3, ends=ends)
    drained.follow("c2", late, MemoryLog())
    late.exit.set(ExitInfo(exit_code=0, finished_at=1))
    await drained.drain("c2")  # what a stop awaits
    assert late.finished is ends
    await drained.aclose()
    await io.aclose()


async def test_a_pipe_is_followed_without_a_task_and_keeps_what_came_before() -> None:
    log = MemoryLog()
    exits = Exits(log)
    io = ContainerIO(exits)
    pipe = ProcessPipe()
    pipe.put("stderr", b"early\n")  # before the shim follows it (between start and follow)
    tasks = len(asyncio.all_tasks())
    io.follow("c1", pipe, log)
    assert len(asyncio.all_tasks()) == tasks
    pipe.put("stdout", b"late\n")
    assert (log.data["stderr"], log.data["stdout"]) == (b"early\n", b"late\n")
    pipe.end()
    pipe.exit.set(ExitInfo(exit_code=0, finished_at=1))
    await asyncio.sleep(0)
    assert [cid for cid, _, _ in exits.seen] == ["c1"]


async def test_a_stop_drains_and_close_ends_the_following() -> None:
    log = MemoryLog()
    exits = Exits(log)
    io = ContainerIO(exits)
    proc = SlowOutput([b"x\n"] * 5, lag=0.01)
    io.follow("c1", proc, log)
    proc.exit.set(ExitInfo(exit_code=143, finished_at=1))
    await io.drain("c1")  # what StopContainer awaits before it records the exit
    assert proc.finished and log.data["stdout"] == b"x\n" * 5
    io.close("c1")
    assert log.closed.is_set() and "c1" not in io
    await asyncio.sleep(0.01)
    # Reported once, when the output ended (the stop's own record of it then changes nothing).
    assert [cid for cid, _, _ in exits.seen] == ["c1"]
    # Closing a process whose output still flows cancels its reader.
    endless = SlowOutput([b"y\n"] * 1000, lag=0.01)
    io.follow("c2", endless, MemoryLog())
    endless.exit.set(ExitInfo(exit_code=0, finished_at=1))
    await asyncio.sleep(0.03)
    io.close("c2")
    await asyncio.sleep(0.03)
    assert not endless.finished and [cid for cid, _, _ in exits.seen] == ["c1"]


def _mount_tmpfs(path: str, size: str) -> bool:
    os.makedirs(path, exist_ok=True)
    if os.geteuid() != 0:
        return False
    return (
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", path], check=False).returncode
        == 0
    )


def test_a_full_disk_drops_counts_says_once_and_resumes(tmp_path: Path) -> None:
    """A log directory on a 64 KiB tmpfs fills up: records are dropped (counted, one warning), the
    writer never raises, a rotation still works, and writing resumes once space returns."""
    disk = str(tmp_path / "disk")
    if not _mount_tmpfs(disk, "64k"):
        pytest.skip("needs root to mount a tmpfs")
    try:
        path = os.path.join(disk, "c.log")
        ballast = os.path.join(disk, "ballast")
        with open(ballast, "wb") as f:  # most of the disk, so that the log fills it soon
            f.write(b"x" * 40 * 1024)
        w = CriLogWriter(path)
        with structlog.testing.capture_logs() as logs:
            for i in range(2000):
                w.write("stdout", b"line %d\n" % i)
            assert w.bytes_dropped > 0
            assert [e["event"] for e in logs].count("io.log_write_failed") == 1
            os.rename(path, path + ".1")
            w.reopen()  # the kubelet's rotation on a full disk: an empty file still fits
            w.write("stdout", b"still full\n")
            dropped = w.bytes_dropped
            os.unlink(ballast)
            w.write("stdout", b"after\n")
            assert "io.log_write_resumed" in [e["event"] for e in logs]
        assert w.bytes_dropped == dropped  # nothing dropped once space returned
        w.close()
        assert read(path)[-1] == (b"stdout", b"F", b"after")
    finally:
        subprocess.run(["umount", "-l", disk], check=False)
