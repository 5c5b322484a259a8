"""A container's command as PID 1 of its PID namespace (backends/fake/shell/process.py, and
backends/fake/lifecycle.py which says when it is one): the kernel gives a namespace's init only the
signals it handles, but KILL and STOP from the runtime."""

from __future__ import annotations

import asyncio

import pytest

from backends.contract import ContainerRecord, SandboxRecord
from backends.fake.exec import FakeExec
from backends.fake.lifecycle import FakeLifecycle
from backends.fake.pids import PidNamespaces
from cri_api import api_pb2 as pb
from tests.fake.harness import Harness, blocked_forever, settle
from tests.fake.test_parts import container, parts, sandbox

# ---------------------------------------------------------------------- the shell


async def test_as_pid_one_the_stop_signal_without_trap_is_ignored() -> None:
    h = Harness(sleep=blocked_forever)
    h.io.init = True
    task = asyncio.create_task(h.run(["sleep", "1800"]))
    await settle()
    h.term.set()
    await settle()
    assert not task.done()  # still sleeping: only the runtime's KILL (a cancel here) ends it
    assert not h.term.is_set()  # taken, and ignored
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


@pytest.mark.parametrize(
    ("script", "init", "stdout", "code"),
    [
        ("trap 'echo got-term; exit 0' TERM; echo start; sleep 100 & wait", True, b"start\ngot-term\n", 0),
        ("echo start; sleep 100", False, b"start\n", 143),  # not PID 1 (the pod's namespace)
        ("trap '' TERM; echo start; sleep 100; echo never", False, b"start\n", None),
    ],
    ids=["init-trap", "not-init-default", "not-init-ignored"],
)
async def test_the_stop_signal_runs_a_trap_or_the_default_unless_pid_one(
    script: str, init: bool, stdout: bytes, code: int | None
) -> None:
    h = Harness(sleep=blocked_forever)
    h.io.init = init
    task = asyncio.create_task(h.run(["sh", "-c", script]))
    await settle()
    h.term.set()
    await settle()
    assert bytes(h.stdout) == stdout
    if code is None:
        assert not task.done()
        task.cancel()
        return
    assert (await task).code == code


async def test_as_pid_one_the_runtimes_kill_ends_it() -> None:
    """A stop signal of KILL comes from the runtime, outside the namespace: the kernel delivers it."""
    h = Harness(sleep=blocked_forever)
    h.io.init, h.io.term_signal = True, "KILL"
    task = asyncio.create_task(h.run(["sleep", "1800"]))
    await settle()
    h.term.set()
    assert (await task).code == 137


@pytest.mark.parametrize(
    ("script", "init", "stdout", "code"),
    [
        ("kill $$; echo still", True, b"still\n", 0),
        ("kill $$; echo never", False, b"", 143),
        ("kill -9 $$; echo still", True, b"still\n", 0),  # not even KILL, from inside the namespace
        ("kill -9 $$; echo never", False, b"", 137),
        ("trap 'echo got-usr1' USR1; kill -USR1 $$; echo after", True, b"got-usr1\nafter\n", 0),
        ("(kill $$) & wait; echo still", True, b"still\n", 0),  # a job's TERM
        ("trap 'echo got-term; exit 3' TERM; (kill $$) & wait; echo never", True, b"got-term\n", 3),
    ],
    ids=["term-init", "term", "kill-init", "kill", "usr1-trapped-init", "job-init", "job-trapped-init"],
)
async def test_kill_to_pid_one_from_the_container(script: str, init: bool, stdout: bytes, code: int) -> None:
    h = Harness()
    h.io.init = init
    result = await h.run(["sh", "-c", script])
    assert (result.stdout, result.code) == (stdout, code)


# ---------------------------------------------------------------------- the runtime


def _own_pid(c: ContainerRecord, mode: pb.NamespaceMode = pb.CONTAINER) -> ContainerRecord:
    c.config.linux.security_context.namespace_options.pid = mode
    return c


async def _running(life: FakeLifecycle, *cs: ContainerRecord) -> SandboxRecord:
    sb = sandbox("5" * 64)
    await life.run_sandbox(sb)
    for c in cs:
        await life.create_container(c, sb)
        await life.start_container(c, sb)
    await settle()
    return sb


async def test_stop_kills_sleep_as_pid_one_after_the_timeout() -> None:
    images, _, life = parts({"pull_seconds": 0})
    await images.pull_image(pb.ImageSpec(image="busybox:1"), None, None)
    own = _own_pid(container("a" * 64, command=["sleep", "1800"]))
    shared = _own_pid(container("b" * 64, command=["sleep", "1800"]), pb.POD)
    await _running(life, own, shared)
    stopping = asyncio.create_task(life.stop_container(own, 1))
    await settle()
    assert not stopping.done()  # TERM ignored: it waits for the timeout
    info = await stopping
    assert (info.exit_code, info.reason) == (137, "Error")
    info = await life.stop_container(shared, 30)  # the pause process is PID 1: TERM ends it
    assert (info.exit_code, info.reason) == (143, "Error")
    await life.close()


async def test_an_execs_kill_1_signals_the_main_process_as_pid_one() -> None:
    images, programs, life = parts({"pull_seconds": 0})
    execs = FakeExec({}, life, programs)
    await images.pull_image(pb.ImageSpec(image="busybox:1"), None, None)
    trapped = _own_pid(container("a" * 64, command=["sh", "-c", "trap 'exit 7' USR1; sleep 1800 & wait"]))
    plain = _own_pid(container("b" * 64, command=["sleep", "1800"]))
    shared = _own_pid(container("c" * 64, command=["sleep", "1800"]), pb.POD)
    await _running(life, trapped, plain, shared)
    for c in (plain, shared):
        for cmd in (["kill", "1"], ["kill", "-9", "1"]):
            assert (await execs.exec_sync(c, cmd)).exit_code == 0
    run = life.running[trapped.id]
    result = await execs.exec_sync(trapped, ["sh", "-c", "echo $$; kill -USR1 1"])
    assert result.stdout != b"1\n"  # an exec is not PID 1
    await settle()
    # PID 1 without a handler, and (in the pod's namespace) the pause process: nothing happens.
    assert plain.id in life.running and shared.id in life.running
    assert trapped.id not in life.running
    assert run.pipe.exit.info is not None and run.pipe.exit.info.exit_code == 7  # its trap ran
    await life.close()


async def test_proc_1_fd_1_and_2_are_the_main_processes_log_to_an_exec_and_to_itself() -> None:
    """Lifecycle hooks write `echo ... > /proc/1/fd/1` to reach the container's log (the node
    e2e lifecycle specs read their timestamps from it); other descriptors of PID 1 cannot be opened."""
    images, programs, life = parts({"pull_seconds": 0})
    execs = FakeExec({}, life, programs)
    await images.pull_image(pb.ImageSpec(image="busybox:1"), None, None)
    c = container("d" * 64, command=["sh", "-c", "echo own > /proc/1/fd/2; sleep 1800"])
    await _running(life, c)
    got: list[tuple[str, bytes]] = []
    life.running[c.id].pipe.connect(lambda out: got.append((out.stream, out.data)), lambda: None)
    hook = await execs.exec_sync(c, ["sh", "-c", "echo from-hook > /proc/1/fd/1; echo to-exec"])
    assert (hook.exit_code, hook.stdout) == (0, b"to-exec\n")
    bad = await execs.exec_sync(c, ["sh", "-c", "echo x > /proc/1/fd/7"])
    assert bad.exit_code == 1 and b"can't create /proc/1/fd/7" in bad.stderr
    assert got == [("stderr", b"own\n"), ("stdout", b"from-hook\n")]
    await life.close()


# ---------------------------------------------------------------------- the processes an exec sees


async def test_pidof_sees_its_pid_namespace() -> None:
    """The node e2e PID namespace specs: `/bin/pidof top` and `pidof sleep` print 1 in containers of
    their own PID namespace; with the pod's namespace shared both containers see `top` at one PID."""
    images, programs, life = parts({"pull_seconds": 0})
    execs = FakeExec({}, life, programs)
    await images.pull_image(pb.ImageSpec(image="busybox:1"), None, None)
    top = _own_pid(container("a" * 64, command=["/bin/top"]))
    sleep = _own_pid(container("b" * 64, command=["/bin/sleep", "10000"]))
    shared_top = _own_pid(container("c" * 64, command=["/bin/top"]), pb.POD)
    shared_sleep = _own_pid(container("d" * 64, command=["/bin/sleep", "10000"]), pb.POD)
    await _running(life, top, sleep, shared_top, shared_sleep)

    async def run(c: ContainerRecord, *cmd: str) -> tuple[int, bytes]:
        result = await execs.exec_sync(c, list(cmd))
        return result.exit_code, result.stdout

    assert await run(top, "/bin/pidof", "top") == (0, b"1\n")
    assert await run(sleep, "/bin/pidof", "sleep") == (0, b"1\n")
    assert await run(sleep, "/bin/pidof", "top") == (1, b"")  # the other container's own namespace
    seen = await run(shared_top, "/bin/pidof", "top")
    assert seen[0] == 0 and seen[1] not in (b"1\n", b"")
    assert await run(shared_sleep, "/bin/pidof", "top") == seen
    code, ps = await run(shared_sleep, "ps")
    assert code == 0 and [line.split()[-1] for line in ps.decode().splitlines()[1:]] == [
        "pause",
        "top",
        "sleep",
    ]
    await life.stop_container(shared_top, 0)
    assert await run(shared_sleep, "pidof", "top") == (1, b"")  # gone with its container
    await life.close()


def test_pid_namespaces_of_a_target_and_the_node() -> None:
    spaces = PidNamespaces()
    app = _own_pid(container("a" * 64, command=["nginx"]))
    debug = _own_pid(container("b" * 64, command=["sh"]), pb.TARGET)
    debug.config.linux.security_context.namespace_options.target_id = app.id
    host = _own_pid(container("c" * 64, command=["/usr/bin/agent"]), pb.NODE)
    assert (spaces.start(app, ["nginx"]), spaces.start(debug, ["sh"]), spaces.start(host, ["agent"])) == (
        1,
        2,
        2,
    )
    assert spaces.seen_from(debug.id) == spaces.seen_from(app.id) == [(1, "nginx"), (2, "sh")]
    assert spaces.seen_from(host.id) == [(1, "init"), (2, "agent")]
    spaces.stop(app.id)
    spaces.stop(debug.id)
    assert spaces.seen_from(debug.id) == [] and spaces.start(app, ["nginx"]) == 1  # a new namespace
