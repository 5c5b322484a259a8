"""How a container runs in the shell: its argv, a script, extra commands, output as produced
(backends/fake/shell/entry.py, caller.py)."""

from __future__ import annotations

import asyncio

import pytest

from backends.fake.shell import ShellIO, run_script
from tests.fake.harness import Harness, settle


async def test_kubelet_idiom_prints_at_once_then_sleeps_without_spinning() -> None:
    calls: list[float] = []
    resume = asyncio.Event()

    async def sleep(seconds: float) -> None:
        calls.append(seconds)
        await resume.wait()

    h = Harness(sleep=sleep)
    task = asyncio.create_task(h.run(["sh", "-c", "echo hello-from-kubelet; while true; do sleep 1; done"]))
    await settle()
    assert bytes(h.stdout) == b"hello-from-kubelet\n"
    assert calls == [1.0] and not task.done()  # one sleeping coroutine, no busy loop
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_output_is_written_as_it_is_produced() -> None:
    seen_at_sleep: list[bytes] = []
    h = Harness()

    async def sleep(seconds: float) -> None:
        seen_at_sleep.append(bytes(h.stdout))

    h.io.sleep = sleep
    await h.run(["sh", "-c", "echo start; sleep 100; echo end"])
    assert seen_at_sleep == [b"start\n"]


@pytest.mark.parametrize(
    ("argv", "stdin", "stdout", "stderr", "code"),
    [
        (["echo", "hi"], b"", b"hi\n", b"", 0),
        (["/bin/echo", "a", "b"], b"", b"a b\n", b"", 0),
        (["sleep", "0"], b"", b"", b"", 0),
        (["cat"], b"typed\nlines\n", b"typed\nlines\n", b"", 0),
        (["/usr/bin/env", "-i", "A=1"], b"", b"A=1\n", b"", 0),
        (["nginx", "-g", "daemon off;"], b"", b"", b"sh: nginx: not found\n", 127),
        (["exit", "3"], b"", b"", b"", 3),
        (["/bin/sh", "-c", "echo $0 $1", "me", "x"], b"", b"me x\n", b"", 0),
        (["bash", "-ec", "false; echo no"], b"", b"", b"", 1),
        (["sh", "-c"], b"", b"", b"sh: -c requires an argument\n", 2),
        (
            ["sh"],
            b"echo one\nif true\nthen echo two\nfi\nread x\nfrom-stdin\necho $x\n",
            b"one\ntwo\nfrom-stdin\n",
            b"",
            0,
        ),
        (["sh", "-s"], b"exit 4\necho no\n", b"", b"", 4),
        ([], b"", b"", b"", 0),
    ],
)
async def test_container_commands(
    argv: list[str], stdin: bytes, stdout: bytes, stderr: bytes, code: int
) -> None:
    result = await Harness([stdin] if stdin else []).run(argv)
    assert (result.stdout, result.stderr, result.code) == (stdout, stderr, code)


async def test_run_script_and_pid() -> None:
    h = Harness()
    h.io.pid = 42
    assert await run_script("echo $$ $0; kill -TERM 1; echo still", h.io) == 0
    assert bytes(h.stdout) == b"42 sh\nstill\n"


async def test_extra_commands_get_argv_env_cwd_and_redirected_streams() -> None:
    seen: list[tuple[list[str], str | None, str, bytes]] = []

    async def lookup(argv: list[str], io: ShellIO) -> int:
        assert io.stdin is not None
        data = await io.stdin()
        seen.append((argv, io.env.get("SERVER"), io.cwd, data))
        await io.stdout(b"Address: 10.0.0.1\n")
        await io.stderr(b"warning\n")
        return 256 + 1  # a status is taken modulo 256

    async def whoami(argv: list[str], io: ShellIO) -> int:
        await io.stdout(b"app\n")
        return 0

    h = Harness()
    h.io.commands = {"nslookup": lookup, "whoami": whoami}
    script = (
        "cd /data; echo query | SERVER=dns /usr/bin/nslookup x 2>/dev/null | grep -c 10.0; echo $?; whoami"
    )
    result = await h.run(["sh", "-c", script])
    assert result.stdout == b"1\n0\napp\n" and result.stderr == b""
    assert seen == [(["/usr/bin/nslookup", "x"], "dns", "/data", b"query\n")]
    assert (await Harness().run(["sh", "-c", "command -v nslookup || echo none"])).stdout == b"none\n"
