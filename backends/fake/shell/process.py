"""One shell process and the session its run shares: state, lifecycle, signals, descriptors, variables.

The evaluator (:mod:`backends.fake.shell.evaluation`) builds on :class:`ShellProcess` with ``run``."""

from __future__ import annotations

import abc
import asyncio
import copy
import errno
import functools
import posixpath
import random
from collections.abc import Awaitable, Callable, Mapping
from typing import Self, TypeVar

from backends.fake.shell.caller import ShellIO
from backends.fake.shell.control import (
    BrokenPipe,
    Exit,
    Interrupted,
    Return,
    ShellError,
    Terminated,
    ToolError,
)
from backends.fake.shell.fs import norm
from backends.fake.shell.lexer import NAME, ParseError
from backends.fake.shell.parser import parse
from backends.fake.shell.streams import NULL, CallbackWriter, Fd, FileWriter, Reader, Writer, dec, enc
from backends.fake.shell.syntax import Node

_T = TypeVar("_T")

_MAX_DEPTH = 1000  # nested function calls, evals, subshells: a runaway recursion stops here
_HOP = 8  # every this many levels the evaluation continues in a fresh task (a short Python stack)


SIGNALS = {
    "EXIT": 0,
    "HUP": 1,
    "INT": 2,
    "QUIT": 3,
    "ILL": 4,
    "TRAP": 5,
    "ABRT": 6,
    "IOT": 6,
    "BUS": 7,
    "FPE": 8,
    "KILL": 9,
    "USR1": 10,
    "SEGV": 11,
    "USR2": 12,
    "PIPE": 13,
    "ALRM": 14,
    "TERM": 15,
    "STKFLT": 16,
    "CHLD": 17,
    "CLD": 17,
    "CONT": 18,
    "STOP": 19,
    "TSTP": 20,
    "TTIN": 21,
    "TTOU": 22,
    "URG": 23,
    "XCPU": 24,
    "XFSZ": 25,
    "VTALRM": 26,
    "PROF": 27,
    "WINCH": 28,
    "IO": 29,
    "POLL": 29,
    "PWR": 30,
    "SYS": 31,
    # The real-time signals as the C library numbers them (it keeps 32 and 33 for itself).
    "RTMIN": 34,
    **{f"RTMIN+{i}": 34 + i for i in range(1, 16)},
    **{f"RTMAX-{i}": 64 - i for i in range(14, 0, -1)},
    "RTMAX": 64,
}
# By default they do not end a process (ignored, or they stop or continue it).
_HARMLESS = frozenset({"CHLD", "CLD", "CONT", "URG", "WINCH", "STOP", "TSTP", "TTIN", "TTOU"})


def signal_name(text: str) -> str | None:
    """TERM for TERM, SIGTERM, term or 15."""
    name = text.upper().removeprefix("SIG")
    if name.isdecimal():
        return next((n for n, number in SIGNALS.items() if number == int(name)), None)
    return name if name in SIGNALS else None


class Session:
    """What the shells of one run share: the container's I/O, background jobs, and which shell
    takes the stop signal (the owner)."""

    def __init__(self, io: ShellIO) -> None:
        self.io = io
        self.term = io.term if io.term is not None else asyncio.Event()  # also set by `kill $$`
        # What setting ``term`` delivers: a signal `kill` sent (io.sent), else the caller's stop signal.
        self.stop_signal = signal_name(io.term_signal) or "TERM"
        self.stdin = Reader(io.stdin)  # one reader: what a command left unread stays for the next
        self.jobs: dict[int, asyncio.Task[int]] = {}
        self.killed: dict[int, int] = {}  # status of jobs stopped by kill
        self.next_pid = io.pid
        self.ticks = 0
        self.owner: ShellProcess

    def pending(self) -> tuple[str, bool]:
        """The signal ``term`` delivers now, and whether a process of the container sent it."""
        return (self.io.sent[0], True) if self.io.sent else (self.stop_signal, False)

    def take(self) -> tuple[str, bool]:
        """The pending signal, taken: ``term`` stays set while another one is queued."""
        pending = self.pending()
        if self.io.sent:
            self.io.sent.pop(0)
        if not self.io.sent:
            self.term.clear()
        return pending

    def add_job(self, task: asyncio.Task[int]) -> int:
        if len(self.jobs) > 64:  # forget finished jobs nobody waited for, in a loop that starts many
            for pid in [pid for pid, job in self.jobs.items() if job.done()]:
                job = self.jobs.pop(pid)
                self.killed.pop(pid, None)
                if not job.cancelled():
                    job.exception()  # retrieved, so that asyncio does not report it
        self.next_pid += 1
        self.jobs[self.next_pid] = task
        return self.next_pid

    def job_status(self, pid: int) -> int:
        """The exit status of a finished job, forgotten once asked, as `wait` does."""
        task = self.jobs.pop(pid)
        if task.cancelled():
            return self.killed.pop(pid, 143)
        return task.result()

    async def stop_jobs(self) -> None:
        """The run ended: so do its background jobs, as when a container's main process exits."""
        tasks = list(self.jobs.values())
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)
        for task in tasks:
            if not task.cancelled():
                task.exception()  # retrieved: a job failing as the container stops is of no interest
        self.jobs.clear()


class ShellProcess(abc.ABC):
    """One shell process: variables, functions, traps, options and open descriptors. Subshells
    (parentheses, pipeline stages, $(...), background jobs) are copies; `sh` starts a new one.
    What it runs, and how, is the evaluator's: :meth:`run`."""

    def __init__(
        self,
        session: Session,
        env: Mapping[str, str],
        arg0: str,
        args: list[str],
        fds: dict[int, Fd],
        cwd: str,
    ) -> None:
        self.session = session
        self.io = session.io
        self.vars: dict[str, str] = dict(env)
        self.exported: set[str] = set(env)
        self.arg0 = arg0
        self.args = args
        self.fds = fds
        self.cwd = cwd
        self.vars["PWD"] = cwd
        self.functions: dict[str, Node] = {}
        self.traps: dict[str, str] = {}
        self.flags: set[str] = set()  # set -e, -x... ("e", "x") and "pipefail"
        self.status = 0
        self.no_errexit = 0  # > 0 in conditions, where set -e does not apply
        self.loop_depth = 0
        self.locals: list[dict[str, str | None]] = []  # per function call: the values `local` hides
        self.sourcing = 0
        self.depth = 0
        self.background = False  # a background job: not signalled, never interrupted
        self.last_job = ""  # $!
        self.subst_status: int | None = None  # of the last $(...) of the current command
        self.exec_next = False  # the shell `exec` (or run) starts next becomes the signal owner

    # -- shells

    def fork(self) -> Self:
        """A subshell: a copy whose changes do not leak back; traps other than ignored ones reset."""
        child = copy.copy(self)
        child.vars = dict(self.vars)
        child.exported = set(self.exported)
        child.args = list(self.args)
        child.fds = dict(self.fds)
        child.functions = dict(self.functions)
        child.traps = {name: action for name, action in self.traps.items() if not action}
        child.flags = set(self.flags)
        child.locals = [dict(frame) for frame in self.locals]
        child.loop_depth = 0
        return child

    def program(self, arg0: str, args: list[str]) -> Self:
        """A new shell process (sh, a script) with this shell's environment and descriptors."""
        child = type(self)(self.session, self.environ(), arg0, args, dict(self.fds), self.cwd)
        child.background = self.background
        child.depth = self.depth
        return child

    async def run_program(self, child: ShellProcess, make: Callable[[], Awaitable[int]]) -> int:
        """Runs a new shell process; one that `exec` started takes SIGTERM while it runs."""
        previous = self.session.owner
        if self.exec_next:
            self.exec_next = False
            self.session.owner = child
        try:
            return await make()
        finally:
            if self.session.owner is child:
                self.session.owner = previous

    def environ(self) -> dict[str, str]:
        return {name: value for name, value in self.vars.items() if name in self.exported}

    def processes(self) -> list[tuple[int, str]]:
        return self.io.processes() if self.io.processes is not None else []

    async def main(self, make: Callable[[], Awaitable[int]]) -> int:
        """The container's program from start to end: its exit code, and no job left behind."""
        try:
            return await self.boundary(make)
        finally:
            await self.session.stop_jobs()

    async def boundary(self, make: Callable[[], Awaitable[int]]) -> int:
        """Runs a whole shell program (script, subshell, $(...), pipeline stage): exit, fatal errors
        and SIGPIPE end it here, then its EXIT trap runs. A signal's end stops at the signal owner."""
        try:
            status = await make()
        except (Exit, Return) as exc:
            status = exc.code
        except ShellError as exc:
            await self.err(f"{self.arg0}: {exc}")
            status = exc.code
        except BrokenPipe:
            status = 128 + SIGNALS["PIPE"]
        except Terminated as exc:
            if self is not self.session.owner:
                raise
            status = exc.code
        return await self._exit_trap(status & 255)

    async def _exit_trap(self, status: int) -> int:
        action = self.traps.pop("EXIT", None)
        if not action:
            return status
        self.status = status
        try:
            await self.eval(action)
        except Exit as exc:
            return exc.code & 255
        except ShellError as exc:
            await self.err(f"{self.arg0}: {exc}")
            return exc.code
        return status

    async def nested(self, make: Callable[[], Awaitable[int]]) -> int:
        """Runs make() one level deeper (a function call, eval, subshell...). Every _HOP levels the
        evaluation continues in a fresh task, which keeps Python's stack short however deep the
        script recurses; beyond _MAX_DEPTH a runaway recursion fails with a message."""
        if self.depth >= _MAX_DEPTH:
            raise ShellError(f"maximum nesting depth ({_MAX_DEPTH}) exceeded: endless recursion?")
        self.depth += 1
        try:
            if self.depth % _HOP:
                return await make()
            return await asyncio.ensure_future(make())
        finally:
            self.depth -= 1

    async def _parsed(self, text: str) -> Node | None:
        """The commands of text, or None once a syntax error is printed."""
        try:
            return parse(text)
        except ParseError as exc:
            await self.err(f"{self.arg0}: syntax error: {exc}")
            return None

    async def run_text(self, text: str) -> int:
        """Runs a script as this shell's program; a syntax error prints and gives 2, running nothing."""
        node = await self._parsed(text)
        return 2 if node is None else await self.subshell(node)

    @abc.abstractmethod
    async def run(self, node: Node) -> int:
        """Runs a command in this shell and gives its status."""

    async def subshell(self, body: Node) -> int:
        """Runs body as the whole program of this (new or forked) shell."""
        return await self.nested(functools.partial(self.boundary, functools.partial(self.run, body)))

    async def eval(self, text: str) -> int:
        """Parses and runs text in this shell: eval, traps."""
        node = await self._parsed(text)
        return 2 if node is None else await self.nested(functools.partial(self.run, node))

    async def call(self, body: Node) -> int:
        """Runs body one level deeper, as a function or a sourced file runs: `return` ends it."""
        try:
            return await self.nested(functools.partial(self.run, body))
        except Return as exc:
            return exc.code

    async def run_stdin(self) -> int:
        """`sh` with no script: runs the commands of stdin as they arrive (kubectl exec -i -- sh)."""
        return await self.boundary(self._stdin_commands)

    async def _stdin_commands(self) -> int:
        reader = self.input()
        pending = ""
        while True:
            try:
                line = await reader.line(self.block)
            except Interrupted:
                await self.check_signals()
                continue
            pending += dec(line)
            if not line and not pending.strip():
                return self.status
            try:
                node = parse(pending)
            except ParseError as exc:
                if line and exc.incomplete:
                    continue
                await self.err(f"{self.arg0}: syntax error: {exc}")
                return 2
            pending = ""
            await self.run(node)

    # -- signals

    def pending_signal(self) -> str:
        """The signal ``term`` delivers now: one a `kill` sent, else the stop signal."""
        return self.session.pending()[0]

    def ignores(self, name: str, inside: bool) -> bool:
        """Whether this shell (the signal owner) ignores signal `name`: trapped with '', harmless by
        default, or it is PID 1 of its namespace (``io.init``) with no trap for it. The kernel gives a
        namespace's init only the signals it handles, but KILL and STOP from an ancestor namespace
        (the runtime's: ``inside`` false)."""
        action = self.traps.get(name)
        if action is not None:
            return action == ""
        if name in _HARMLESS:
            return True
        return self.io.init and (inside or name not in ("KILL", "STOP"))

    async def check_signals(self) -> None:
        """Takes a pending signal between commands: its trap runs here, or the run ends (143 for
        TERM, 128 + its number for another), or nothing happens when the owner ignores it."""
        if self.session.term.is_set() and not self.background:
            name, inside = self.session.take()
            await self.session.owner.signal(name, inside)

    async def signal(self, name: str, inside: bool = False) -> None:
        """What signal `name` does to this shell: its trap, nothing if ignored, else the end.
        ``inside``: a process of the container sent it (`kill`), not the runtime."""
        if self.ignores(name, inside):
            return
        action = self.traps.get(name)
        if action is None:
            raise Terminated(128 + SIGNALS[name])
        saved = self.status
        try:
            await self.eval(action)
        except Exit as exc:
            raise Terminated(exc.code & 255) from None
        self.status = saved

    async def block(self, awaitable: Awaitable[_T]) -> _T:
        """Awaits a blocking operation (sleep, wait, a read) that SIGTERM interrupts, unless the
        signal is ignored or this is a background job; Interrupted lets the trap run after it."""
        if self.background:
            return await awaitable
        term = self.session.term
        task = asyncio.ensure_future(awaitable)
        waiter: asyncio.Task[bool] | None = None
        try:
            while not task.done():
                if term.is_set():
                    if not self.session.owner.ignores(*self.session.pending()):
                        raise Interrupted
                    self.session.take()  # ignored: what was interrupted goes on
                    continue
                waiter = asyncio.ensure_future(term.wait())
                await asyncio.wait((task, waiter), return_when=asyncio.FIRST_COMPLETED)
                waiter.cancel()
            return task.result()
        finally:
            task.cancel()
            if waiter is not None:
                waiter.cancel()

    async def sleep_forever(self) -> None:
        await self.block(asyncio.get_running_loop().create_future())

    async def kill(self, pid: int, name: str) -> None:
        """kill: to this shell ($$) a background job delivers only TERM; a job of ours is stopped;
        PID 1 from an exec (``io.kill_init``) is the container's main process."""
        if pid == self.io.pid:
            if name == "TERM":
                self.io.sent.append(name)
                self.session.term.set()
            elif not self.background:
                await self.session.owner.signal(name, inside=True)
            return
        if pid == 1 and self.io.kill_init is not None:
            self.io.kill_init(name)
            return
        job = self.session.jobs.get(pid)
        if job is not None and not job.done():
            self.session.killed[pid] = 128 + SIGNALS[name]
            job.cancel()

    # -- descriptors

    def input(self) -> Reader:
        fd = self.fds.get(0)
        return fd if isinstance(fd, Reader) else Reader()

    def writer(self, n: int) -> Writer:
        fd = self.fds.get(n)
        return fd if isinstance(fd, Writer) else NULL

    async def out(self, data: bytes | str) -> None:
        await self.writer(1).write(data if isinstance(data, bytes) else enc(data))

    async def err(self, line: str) -> None:
        await self.writer(2).write(enc(line + "\n"))

    async def read(self, reader: Reader) -> bytes:
        return await reader.chunk(self.block)

    async def read_all(self, reader: Reader) -> bytes:
        return await reader.rest(self.block)

    def abspath(self, path: str) -> str:
        return norm(posixpath.join(self.cwd, path))

    def _device(self, path: str, reading: bool) -> Fd | None:
        """/dev/null, /dev/std{in,out,err} and /dev/fd/N, which are no files of io.fs."""
        if path == "/dev/null":
            return Reader() if reading else NULL
        fd = {"/dev/stdin": 0, "/dev/stdout": 1, "/dev/stderr": 2}.get(path)
        if (
            fd is None
            and path.startswith(("/dev/fd/", "/proc/self/fd/"))
            and path.rsplit("/", 1)[1].isdecimal()
        ):
            fd = int(path.rsplit("/", 1)[1])
        if fd is None and path.startswith("/proc/1/fd/") and path.rsplit("/", 1)[1].isdecimal():
            return self._init_fd(int(path.rsplit("/", 1)[1]), reading)
        if fd is None:
            return None
        return self.fds.get(fd) or (Reader() if reading else NULL)

    def _init_fd(self, fd: int, reading: bool) -> Fd:
        """/proc/1/fd/N: PID 1's stdout or stderr, which is the container's log; an exec reaches
        it as much as the main process. Anything else there cannot be opened here."""
        send = self.io.init_output(fd) if self.io.init_output is not None and not reading else None
        if send is None:
            raise FileNotFoundError(errno.ENOENT, "No such file or directory")
        return CallbackWriter(send)

    def open_input(self, name: str) -> Reader:
        """A file operand of cat, head, grep...: "-" is stdin; raises OSError."""
        if name == "-":
            return self.input()
        device = self._device(self.abspath(name), reading=True)
        if device is not None:
            return device if isinstance(device, Reader) else Reader()
        return Reader(data=self.io.fs.read(self.abspath(name)))

    def open_output(self, name: str, append: bool) -> Writer:
        """A file opened for writing (created, truncated unless append); raises OSError."""
        device = self._device(self.abspath(name), reading=False)
        if device is not None:
            return device if isinstance(device, Writer) else NULL
        path = self.abspath(name)
        self.io.fs.write(path, b"", append=append)
        return FileWriter(self.io.fs, path)

    # -- variables

    def get(self, name: str) -> str | None:
        value = self.vars.get(name)
        if value is not None:
            return value
        if name.isdecimal():
            n = int(name)
            return self.arg0 if n == 0 else self.args[n - 1] if n <= len(self.args) else None
        special = _SPECIAL_PARAMS.get(name)
        return special(self) if special is not None else None

    def declare(self, item: str) -> str:
        """NAME or NAME=value, as export, readonly and local take them; returns NAME."""
        name, eq, value = item.partition("=")
        if not NAME.fullmatch(name):
            raise ToolError(f"{name}: bad variable name")
        if eq:
            self.vars[name] = value
        return name

    def restore(self, values: Mapping[str, str | None]) -> None:
        """Sets variables back to what they were: a value, or unset (None)."""
        for name, value in values.items():
            if value is None:
                self.vars.pop(name, None)
            else:
                self.vars[name] = value


_SPECIAL_PARAMS: dict[str, Callable[[ShellProcess], str | None]] = {
    "?": lambda sh: str(sh.status),
    "$": lambda sh: str(sh.io.pid),
    "#": lambda sh: str(len(sh.args)),
    "@": lambda sh: " ".join(sh.args),
    "*": lambda sh: sh.vars.get("IFS", " ")[:1].join(sh.args),
    "!": lambda sh: sh.last_job or None,
    "-": lambda sh: "".join(sorted(f for f in sh.flags if len(f) == 1)),
    "RANDOM": lambda sh: str(random.randrange(32768)),
}
