"""SIGTERM, traps and background jobs: how a container's shell is stopped
(backends/fake/shell/process.py)."""

from __future__ import annotations

import asyncio

import pytest

from tests.fake.harness import Harness, blocked_forever, settle


async def test_term_without_trap_ends_with_143() -> None:
    h = Harness(sleep=blocked_forever)
    task = asyncio.create_task(h.run(["sh", "-c", "echo start; sleep 100; echo never"]))
    await settle()
    assert bytes(h.stdout) == b"start\n" and not task.done()
    h.term.set()
    result = await task
    assert (result.stdout, result.code) == (b"start\n", 143)


async def test_term_trap_runs_at_the_interrupted_command_then_continues() -> None:
    h = Harness(sleep=blocked_forever)
    script = "trap 'echo got-term' TERM; echo start; sleep 100; echo after $?; sleep 5; echo end"
    task = asyncio.create_task(h.run(["sh", "-c", script]))
    await settle()
    h.term.set()
    await settle()
    assert bytes(h.stdout) == b"start\ngot-term\nafter 143\n" and not task.done()
    assert not h.term.is_set()  # taken: setting it again delivers another
    h.term.set()
    result = await task
    assert (result.stdout, result.code) == (b"start\ngot-term\nafter 143\ngot-term\nend\n", 0)


async def test_trap_exit_in_term_trap_with_background_sleep_and_wait() -> None:
    h = Harness(sleep=blocked_forever)
    task = asyncio.create_task(
        h.run(["sh", "-c", "trap 'echo bye; exit 0' TERM; echo hello; sleep 30 & wait"])
    )
    await settle()
    assert bytes(h.stdout) == b"hello\n" and not task.done()
    h.term.set()
    result = await task
    assert (result.stdout, result.stderr, result.code) == (b"hello\nbye\n", b"", 0)


async def test_term_ignored_by_empty_trap() -> None:
    release = asyncio.Event()

    async def sleep(seconds: float) -> None:
        await release.wait()

    h = Harness(sleep=sleep)
    task = asyncio.create_task(h.run(["sh", "-c", "trap '' TERM; sleep 10; echo finished"]))
    await settle()
    h.term.set()
    await settle()
    assert not task.done()
    release.set()
    result = await task
    assert (result.stdout, result.code) == (b"finished\n", 0)


async def test_term_interrupts_a_blocking_read() -> None:
    never = asyncio.Event()

    async def stdin() -> bytes:
        await never.wait()
        return b""

    h = Harness()
    h.io.stdin = stdin
    task = asyncio.create_task(
        h.run(["sh", "-c", "trap 'echo t' TERM; read x; echo read=$?; cat; echo cat=$?"])
    )
    await settle()
    h.term.set()
    await settle()
    assert bytes(h.stdout) == b"t\nread=143\n"
    h.term.set()
    result = await task
    assert result.stdout == b"t\nread=143\nt\ncat=143\n"


async def test_term_goes_to_the_shell_exec_started() -> None:
    h = Harness(sleep=blocked_forever)
    script = "trap 'echo outer' TERM; exec sh -c \"trap 'echo inner; exit 7' TERM; sleep 100\""
    task = asyncio.create_task(h.run(["sh", "-c", script]))
    await settle()
    h.term.set()
    result = await task
    assert (result.stdout, result.code) == (b"inner\n", 7)


async def test_term_without_trap_stops_a_pipeline() -> None:
    h = Harness(sleep=blocked_forever)
    task = asyncio.create_task(h.run(["sh", "-c", "sleep 100 | cat; echo never"]))
    await settle()
    h.term.set()
    assert (await task).code == 143


@pytest.mark.parametrize("argv", [["sleep", "3600"], ["sleep", "infinity"], ["tail", "-f", "/dev/null"]])
async def test_a_plain_blocking_command_takes_term(argv: list[str]) -> None:
    h = Harness(sleep=blocked_forever)
    task = asyncio.create_task(h.run(argv))
    await settle()
    h.term.set()
    assert (await task).code == 143


async def test_cancelling_the_run_stops_its_jobs() -> None:
    h = Harness(sleep=blocked_forever)
    before = len(asyncio.all_tasks())
    task = asyncio.create_task(h.run(["sh", "-c", "sleep 100 & sleep 200 & yes > /dev/null & wait"]))
    await settle()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await settle()
    assert len(asyncio.all_tasks()) == before


async def test_jobs_are_stopped_when_the_script_ends() -> None:
    h = Harness(sleep=blocked_forever)
    before = len(asyncio.all_tasks())
    result = await h.run(["sh", "-c", "sleep 100 & echo started $!"])
    await settle()
    assert result.stdout == b"started 2\n" and len(asyncio.all_tasks()) == before


async def test_the_stop_signal_is_the_one_the_caller_names() -> None:
    """A container with another stop signal (its config's or its image's): that signal's trap runs,
    the TERM trap does not; with no trap the shell ends with 128 + its number."""
    h = Harness(sleep=blocked_forever)
    h.io.term_signal = "QUIT"
    script = "trap 'echo got-term' TERM; trap 'echo got-quit; exit 0' QUIT; echo start; sleep 30 & wait"
    task = asyncio.create_task(h.run(["sh", "-c", script]))
    await settle()
    h.term.set()
    result = await task
    assert (result.stdout, result.code) == (b"start\ngot-quit\n", 0)

    untrapped = Harness(sleep=blocked_forever)
    untrapped.io.term_signal = "RTMIN+3"
    task = asyncio.create_task(untrapped.run(["sh", "-c", "trap 'echo got-term' TERM; sleep 100"]))
    await settle()
    untrapped.term.set()
    result = await task
    assert (result.stdout, result.code) == (b"", 128 + 37)


async def test_a_stop_signal_that_ends_nothing_by_default_is_ignored() -> None:
    """WINCH as a stop signal, untrapped: the shell goes on (the runtime kills it after the grace)."""
    release = asyncio.Event()

    async def sleep(seconds: float) -> None:
        await release.wait()

    h = Harness(sleep=sleep)
    h.io.term_signal = "WINCH"
    task = asyncio.create_task(h.run(["sh", "-c", "sleep 10; echo finished"]))
    await settle()
    h.term.set()
    await settle()
    assert not task.done() and not h.term.is_set()
    release.set()
    result = await task
    assert (result.stdout, result.code) == (b"finished\n", 0)


async def test_kill_from_a_job_still_sends_term_whatever_the_stop_signal() -> None:
    h = Harness(sleep=blocked_forever)
    h.io.term_signal = "QUIT"
    script = "trap 'echo got-term; exit 3' TERM; trap 'echo got-quit' QUIT; (kill $$) & sleep 100"
    result = await asyncio.wait_for(h.run(["sh", "-c", script]), 10)
    assert (result.stdout, result.code) == (b"got-term\n", 3)
