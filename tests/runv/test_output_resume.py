"""A restarted shim gets from runv's agent exactly what its CRI log is missing: nothing lost that
was in flight to the shim that went away, nothing written twice, an unterminated line whole."""

from __future__ import annotations

import asyncio
import collections
from pathlib import Path
from typing import Any

from backends.runv.agent.guest import Container
from backends.runv.agent.protocol import Ch
from backends.runv.backend import RunvBackend
from shim.cri.container_io import CriLogWriter, last_log_marks
from tests.follow import MemoryLog
from tests.runv.helpers import Events, container_record, needs_vm, sandbox_record

IMAGE = "test/busybox:1"


def _pieces(c: Container) -> list[tuple[int, bytes]]:
    return [(ch, data) for _at, ch, data in c.history]


def test_replay_after_marks() -> None:
    c = Container("c", "/nowhere", tty=False)
    c.output(Ch.STDOUT, b"one\npa")
    c.output(Ch.STDERR, b"two\n")
    c.output(Ch.STDOUT, b"rt")
    (t1, _, _), (t2, _, _), (t3, _, _) = c.history
    assert t1 < t2 < t3  # unique times, also within one clock tick
    # Nobody was subscribed: nothing was delivered; a host that says nothing gets all of it.
    assert [(ch, d) for _, ch, d in c.replay(None)] == _pieces(c)
    # The log holds "one" (at t1) and nothing of stderr: the rest of t1's piece, and the others.
    after = {int(Ch.STDOUT): t1, int(Ch.STDERR): 0}
    assert [(ch, d) for _, ch, d in c.replay(after)] == [
        (Ch.STDOUT, b"pa"),
        (Ch.STDERR, b"two\n"),
        (Ch.STDOUT, b"rt"),
    ]
    # The log holds everything up to t3's piece, which has no newline: it was pending, not logged.
    after = {int(Ch.STDOUT): t3, int(Ch.STDERR): t2}
    assert c.replay(after) == []
    # A piece ending in a newline at the mark was logged whole.
    c.output(Ch.STDOUT, b"x\n")
    t4 = c.history[-1][0]
    assert c.replay({int(Ch.STDOUT): t4, int(Ch.STDERR): t2}) == []


def test_history_is_bounded() -> None:
    from backends.runv.agent import guest

    c = Container("c", "/nowhere", tty=False)
    chunk = b"y" * 4096 + b"\n"
    for _ in range(guest.OUTPUT_BUFFER // len(chunk) + 50):
        c.output(Ch.STDOUT, chunk)
    assert c.history_size <= guest.OUTPUT_BUFFER
    assert collections.Counter(d for _, _, d in c.history) == {chunk: len(c.history)}


def _records(path: Path) -> list[tuple[str, str, str]]:
    out = []
    for line in path.read_text().splitlines():
        _ts, stream, tag, content = line.split(" ", 3)
        out.append((stream, tag, content))
    return out


@needs_vm
async def test_a_restart_gets_what_the_log_is_missing(
    runv_config: dict[str, Any], busybox_rootfs: Path, tmp_path: Path
) -> None:
    """The first shim logs some output, another part is still in flight (its writer drops it),
    an unterminated line is pending; the second shim, given the log's marks, logs the rest once."""
    script = "echo one; echo two >&2; printf part; sleep 3; echo -more; echo three >&2; sleep 3600"
    first = RunvBackend("runv", dict(runv_config))
    ev1 = Events()
    await first.lifecycle.start(ev1)
    first.image_store.import_dir(IMAGE, str(busybox_rootfs))
    sb = sandbox_record("resume")
    await first.lifecycle.run_sandbox(sb)
    sb.committed = True
    ct = container_record(sb, IMAGE, ["sh", "-c", script])
    await first.lifecycle.create_container(ct, sb)
    log = tmp_path / "c.log"
    writer = CriLogWriter(str(log))

    class LosesStderr(MemoryLog):
        """Logs stdout; what comes on stderr is lost, as output in flight to a dying shim is."""

        def write(self, stream: str, data: bytes, at: int = 0) -> None:
            super().write(stream, data, at)
            if stream == "stdout":
                writer.write(stream, data, at)

    seen = LosesStderr()
    await ev1.start(first.lifecycle, ct, sb, seen)
    ct.committed = True
    for _ in range(50):
        if b"part" in seen.data["stdout"] and seen.data["stderr"]:
            break
        await asyncio.sleep(0.1)
    assert bytes(seen.data["stdout"]) == b"one\npart" and bytes(seen.data["stderr"]) == b"two\n"
    await ev1.close()
    await first.lifecycle.close()
    writer.close(flush=False)  # the shim's shutdown: the pending "part" is not written
    assert _records(log) == [("stdout", "F", "one")]

    second = RunvBackend("runv", dict(runv_config))
    ev2 = Events()
    await second.lifecycle.start(ev2)
    try:
        await second.lifecycle.recover([sb], [ct])
        marks = last_log_marks(str(log))
        assert await ev2.reattach(second.lifecycle, ct, CriLogWriter(str(log)), after=marks)
        for _ in range(100):
            if len(_records(log)) >= 4:
                break
            await asyncio.sleep(0.1)
        await asyncio.sleep(0.3)
        assert sorted(_records(log)) == sorted(
            [
                ("stdout", "F", "one"),
                ("stderr", "F", "two"),
                ("stdout", "F", "part-more"),
                ("stderr", "F", "three"),
            ]
        )
        await second.lifecycle.stop_sandbox(sb)
    finally:
        await ev2.close()
        for pod in list(second._shared.pods.values()):
            await second.hv.destroy(pod.vm)
        await second.lifecycle.close()


def test_a_read_longer_than_a_frame_is_cut_into_pieces_of_one_frame() -> None:
    from backends.runv.agent import guest
    from backends.runv.agent.protocol import MAX_CHUNK, STAMP

    c = Container("c", "/nowhere", tty=False)
    data = bytes(range(256)) * (MAX_CHUNK // 256 + 3)
    c.output(Ch.STDOUT, data)
    pieces = list(c.history)
    assert all(len(d) + STAMP.size <= MAX_CHUNK for _, _, d in pieces) and len(pieces) == 2
    assert b"".join(d for _, _, d in pieces) == data and pieces[0][0] < pieces[1][0]
    assert guest.PIECE == MAX_CHUNK - STAMP.size
