"""The evaluator: commands run (lists, pipelines, compound commands, simple commands) and names
looked up (special builtins, functions, extra commands, tools, scripts)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import posixpath
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Any, TypeAlias

from backends.fake.shell import expansion, redirection
from backends.fake.shell.caller import Command
from backends.fake.shell.control import (
    Break,
    Continue,
    Exit,
    Interrupted,
    ToolError,
    propagate,
    reason,
)
from backends.fake.shell.parser import KEYWORDS
from backends.fake.shell.patterns import glob
from backends.fake.shell.process import SIGNALS, ShellProcess
from backends.fake.shell.streams import Pipe, Reader, dec
from backends.fake.shell.syntax import (
    AndOr,
    Case,
    For,
    FuncDef,
    Group,
    If,
    Loop,
    Node,
    Pipeline,
    Redirected,
    Seq,
    Simple,
    Subshell,
    Word,
)

_YIELD_EVERY = 256  # commands between two yields to the event loop, for loops that never block
_SHELLS = frozenset({"sh", "bash", "ash", "dash"})

Builtin: TypeAlias = Callable[["Shell", list[str]], Awaitable[int]]
"""A command written here: ``await fn(shell, argv)`` gives its exit status."""

# The tables that names are looked up in; entry.py fills them from builtins.py and tools/, which are
# written on this module, so that it does not import them.
SPECIAL: dict[str, Builtin] = {}  # special builtins (cd, export, trap...), found before functions
TOOLS: dict[str, Builtin] = {}  # programs (echo, cat, sh...), found as a container's would be


class Shell(ShellProcess):
    """A shell process that runs commands: the evaluator of the syntax tree."""

    # -- commands

    async def run(self, node: Node) -> int:
        status = await _RUNNERS[type(node)](self, node)
        self.status = status
        return status

    def _errexit(self, status: int) -> None:
        if status and "e" in self.flags and not self.no_errexit:
            raise Exit(status)

    async def _condition(self, node: Node) -> int:
        self.no_errexit += 1
        try:
            return await self.run(node)
        finally:
            self.no_errexit -= 1

    async def _run_seq(self, node: Seq) -> int:
        for item, background in node.items:
            if background:
                self._spawn(item)
            else:
                await self.run(item)
        return self.status

    def _spawn(self, node: Node) -> None:
        """cmd &: a background job, with stdin from /dev/null as in a non-interactive shell."""
        job = self.fork()
        job.background = True
        job.fds[0] = Reader()
        self.last_job = str(self.session.add_job(asyncio.ensure_future(job.subshell(node))))
        self.status = 0

    async def _run_and_or(self, node: AndOr) -> int:
        # set -e ignores every failure but the last command's.
        last = len(node.rest) - 1
        status = await self._condition(node.first)
        for i, (op, pipeline) in enumerate(node.rest):
            if (op == "&&") != (status == 0):
                continue
            status = await (self.run(pipeline) if i == last else self._condition(pipeline))
        return status

    async def _run_pipeline(self, node: Pipeline) -> int:
        if node.negate:
            status = await self._condition(Pipeline(node.cmds, False) if len(node.cmds) > 1 else node.cmds[0])
            return int(status == 0)
        status = await self._stages(node.cmds)
        self._errexit(status)
        return status

    async def _stages(self, cmds: Sequence[Node]) -> int:
        """A pipeline: its commands run concurrently, each in a subshell, joined by bounded pipes."""
        pipes = [Pipe() for _ in cmds[1:]]
        tasks = []
        for i, cmd in enumerate(cmds):
            stage = self.fork()
            source = pipes[i - 1] if i else None
            sink = pipes[i] if i < len(pipes) else None
            if source is not None:
                stage.fds[0] = Reader(source.read)
            if sink is not None:
                stage.fds[1] = sink
            tasks.append(asyncio.ensure_future(stage._stage(cmd, source, sink)))
        statuses = await _join(tasks)
        if "pipefail" in self.flags:
            return next((s for s in reversed(statuses) if s), 0)
        return statuses[-1]

    async def _stage(self, cmd: Node, source: Pipe | None, sink: Pipe | None) -> int:
        try:
            return await self.subshell(cmd)
        finally:
            if sink is not None:
                sink.close_write()  # end of input for the next stage
            if source is not None:
                source.close_read()  # the previous stage's next write breaks

    async def _run_group(self, node: Group) -> int:
        return await self.run(node.body)

    async def _run_subshell(self, node: Subshell) -> int:
        status = await self.fork().subshell(node.body)
        self._errexit(status)
        return status

    async def _run_if(self, node: If) -> int:
        for cond, body in node.branches:
            if await self._condition(cond) == 0:
                return await self.run(body)
        return await self.run(node.orelse) if node.orelse is not None else 0

    @contextlib.contextmanager
    def _looping(self) -> Iterator[None]:
        """Inside a loop: what ``break N`` and ``continue N`` may count."""
        self.loop_depth += 1
        try:
            yield
        finally:
            self.loop_depth -= 1

    async def _run_loop(self, node: Loop) -> int:
        status = 0
        with self._looping():
            while True:
                try:
                    if (await self._condition(node.cond) == 0) == node.until:
                        break
                except Break as jump:  # `break` in the condition
                    propagate(jump)
                    status = 0
                    break
                status, broke = await self._iteration(node.body)
                if broke:
                    break
        return status

    async def _iteration(self, body: Node) -> tuple[int, bool]:
        """One pass of a loop's body: its status, and whether a ``break`` ended the loop."""
        try:
            return await self.run(body), False
        except Break as jump:
            propagate(jump)
            return 0, True
        except Continue as jump:
            propagate(jump)
            return 0, False

    async def _run_for(self, node: For) -> int:
        items = list(self.args) if node.items is None else await expansion.argv(self, node.items)
        status = 0
        with self._looping():
            for item in items:
                self.vars[node.var] = item
                status, broke = await self._iteration(node.body)
                if broke:
                    break
        return status

    async def _run_case(self, node: Case) -> int:
        value = await expansion.string(self, node.word)
        for patterns, body in node.items:
            for pattern in patterns:
                if glob(await expansion.pattern(self, pattern)).fullmatch(value):
                    return await self.run(body) if body is not None else 0
        return 0

    async def _run_funcdef(self, node: FuncDef) -> int:
        self.functions[node.name] = node.body
        return 0

    async def _run_redirected(self, node: Redirected) -> int:
        fds = await redirection.redirect(self, node.redirs)
        if fds is None:
            return 1
        saved, self.fds = self.fds, fds
        try:
            return await self.run(node.cmd)
        finally:
            self.fds = saved

    async def _run_simple(self, node: Simple) -> int:
        session = self.session
        session.ticks += 1
        if not session.ticks % _YIELD_EVERY:
            await asyncio.sleep(0)  # a loop that never blocks must not starve the event loop
        self.subst_status = None
        argv = await expansion.argv(self, node.words) if node.words else []
        status = await self._command(argv, node) if argv else await self._assign(node)
        self.status = status
        await self.check_signals()
        self._errexit(status)
        return status

    async def _assign(self, node: Simple) -> int:
        for name, word in node.assigns:
            self.vars[name] = await expansion.string(self, word)
        # `> file` alone creates the file.
        if node.redirs and await redirection.redirect(self, node.redirs) is None:
            return 1
        return self.subst_status or 0

    async def _command(self, argv: list[str], node: Simple) -> int:
        saved_fds = self.fds
        if node.redirs:
            fds = await redirection.redirect(self, node.redirs)
            if fds is None:
                return 1
            self.fds = fds
        if argv == ["exec"]:
            return 0  # exec with only redirections: they stay for the rest of the shell
        saved_vars = await self._prefix_assign(node.assigns)
        try:
            if "x" in self.flags:
                await self.err("+ " + " ".join(argv))
            return await self.invoke(argv)
        except Interrupted:
            return 128 + SIGNALS[self.pending_signal()]
        finally:
            self.fds = saved_fds
            self._restore(saved_vars)

    async def _prefix_assign(self, assigns: Sequence[tuple[str, Word]]) -> dict[str, tuple[str | None, bool]]:
        """X=1 cmd: X is set and exported for the command only; returns what to restore."""
        saved: dict[str, tuple[str | None, bool]] = {}
        for name, word in assigns:
            value = await expansion.string(self, word)
            saved.setdefault(name, (self.vars.get(name), name in self.exported))
            self.vars[name] = value
            self.exported.add(name)
        return saved

    def _restore(self, saved: dict[str, tuple[str | None, bool]]) -> None:
        self.restore({name: value for name, (value, _) in saved.items()})
        self.exported -= {name for name, (_, exported) in saved.items() if not exported}

    # -- names

    async def invoke(self, argv: list[str], functions: bool = True) -> int:
        """Runs a command by name: a special builtin, a function, or what `external` finds."""
        special = SPECIAL.get(argv[0])
        if special is not None:
            return await self._builtin(special, argv, f"{self.arg0}: " + argv[0])
        body = self.functions.get(argv[0]) if functions else None
        if body is not None:
            return await self._call_function(body, argv)
        return await self.external(argv)

    async def external(self, argv: list[str]) -> int:
        """What is a program in a real container: an extra command of the caller, a built-in tool
        (also as /bin/NAME), or a shell script of io.fs (by path or on PATH)."""
        name = argv[0]
        if "/" in name and self._noexec(self.abspath(name)) and self.io.fs.exists(self.abspath(name)):
            # A file of a noexec mount does not run, whatever it is (execve says EACCES).
            await self.err(f"{self.arg0}: {name}: Permission denied")
            return 126
        command = self._extra(name)
        if command is not None:
            return await self._call_extra(command, argv)
        base = name.rsplit("/", 1)[-1]
        tool = TOOLS.get(base)
        if tool is not None:
            return await self._builtin(tool, argv, base)
        script = self.find_script(name)
        if script is not None:
            if self._noexec(script):
                await self.err(f"{self.arg0}: {name}: Permission denied")
                return 126
            return await self._run_script_file(script, argv)
        if self.io.unknown_runs:
            await self.sleep_forever()  # SIGTERM ends it as it ends a sleep
            return 0
        await self.err(f"{self.arg0}: {name}: not found")
        return 127

    def _noexec(self, path: str) -> bool:
        """Whether the file system says ``path`` is on a noexec mount (a container's volumes)."""
        noexec = getattr(self.io.fs, "noexec", None)
        return bool(noexec(path)) if callable(noexec) else False

    def _extra(self, name: str) -> Command | None:
        """The caller's extra command that name runs: by its name, or by a path ending in it."""
        commands = self.io.commands
        return commands.get(name) or (commands.get(name.rsplit("/", 1)[-1]) if "/" in name else None)

    async def _builtin(self, fn: Builtin, argv: list[str], prefix: str) -> int:
        try:
            return await fn(self, argv)
        except ToolError as exc:
            await self.err(f"{prefix}: {exc}")
            return exc.code

    async def _call_extra(self, command: Command, argv: list[str]) -> int:
        reader = self.input()

        async def read() -> bytes:
            return await reader.chunk(self.block)

        io = dataclasses.replace(
            self.io,
            env=self.environ(),
            cwd=self.cwd,
            stdin=read,
            stdout=self.writer(1).write,
            stderr=self.writer(2).write,
            term=self.session.term,
        )
        return await command(list(argv), io) & 255

    async def _call_function(self, body: Node, argv: list[str]) -> int:
        saved_args, saved_loops = self.args, self.loop_depth
        self.args, self.loop_depth = argv[1:], 0
        self.locals.append({})
        try:
            return await self.call(body)
        finally:
            self.restore(self.locals.pop())
            self.args, self.loop_depth = saved_args, saved_loops

    def find_script(self, name: str) -> str | None:
        """The path of a file of io.fs that `name` runs: a path, or a name on PATH."""
        fs = self.io.fs
        if "/" in name:
            candidates = [self.abspath(name)]
        else:
            candidates = [
                self.abspath(posixpath.join(d or ".", name)) for d in self.vars.get("PATH", "").split(":")
            ]
        return next((p for p in candidates if fs.exists(p) and not fs.is_dir(p)), None)

    async def _run_script_file(self, path: str, argv: list[str]) -> int:
        try:
            text = dec(self.io.fs.read(path))
        except OSError as exc:
            await self.err(f"{self.arg0}: {argv[0]}: {reason(exc)}")
            return 126
        interpreter = _shebang(text)
        if interpreter not in _SHELLS:
            await self.err(f"{self.arg0}: {argv[0]}: cannot run a {interpreter} script here")
            return 126
        child = self.program(argv[0], argv[1:])
        return await self.run_program(child, functools.partial(child.run_text, text))

    def describe(self, name: str) -> tuple[str, str] | None:
        """How name would run, for command -v, type and which: (kind, what to print)."""
        if name in KEYWORDS:
            return "keyword", name
        if name in SPECIAL:
            return "builtin", name
        if name in self.functions:
            return "function", name
        if self._extra(name) is not None or name.rsplit("/", 1)[-1] in TOOLS:
            return "file", name if "/" in name else "/bin/" + name
        script = self.find_script(name)
        return ("file", script) if script is not None else None


_RUNNERS: dict[type, Callable[[Shell, Any], Awaitable[int]]] = {
    Simple: Shell._run_simple,
    Pipeline: Shell._run_pipeline,
    AndOr: Shell._run_and_or,
    Seq: Shell._run_seq,
    Group: Shell._run_group,
    Subshell: Shell._run_subshell,
    If: Shell._run_if,
    Loop: Shell._run_loop,
    For: Shell._run_for,
    Case: Shell._run_case,
    FuncDef: Shell._run_funcdef,
    Redirected: Shell._run_redirected,
}


def _shebang(text: str) -> str:
    """The interpreter a script names (its basename; `env X` gives X); "sh" without #!."""
    if not text.startswith("#!"):
        return "sh"
    words = text[2:].split("\n", 1)[0].split()
    if not words:
        return "sh"
    name = words[0].rsplit("/", 1)[-1]
    operands = [w for w in words[1:] if not w.startswith("-")]
    return operands[0] if name == "env" and operands else name


async def _join(tasks: list[asyncio.Task[int]]) -> list[int]:
    """The statuses of a pipeline's stages; if one fails (an unhandled TERM), the others stop."""
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    finally:
        pending = [t for t in tasks if not t.done()]
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.wait(pending)
    errors = [t.exception() for t in tasks if not t.cancelled()]
    error = next((e for e in errors if e is not None), None)
    if error is not None:
        raise error
    return [t.result() for t in tasks]
