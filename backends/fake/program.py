"""What a fake container "runs": scripted programs and a tiny shell for built-ins.

A program is output lines written over time, then an exit with a code
after a duration — or, by default, running until stopped. Programs come
from (first match wins):

1. the container annotation ``fake.cri-shim.io/program``: JSON such as
   ``{"output": ["hello", {"after": 0.5, "stream": "stderr", "line": "oops"}],
   "exit_code": 3, "exit_after": 1.0, "ignore_sigterm": false}``;
2. the handler's ``programs`` table in the config, by image name or repository;
3. the container's command, when it is made only of built-ins (below);
4. otherwise: run until stopped, with no output.

Built-ins, for ExecSync and exec as well: ``echo [-n] ...``, ``true``,
``false``, ``exit N``, ``sleep N``, ``cat`` (copies stdin), ``cat FILE``
(the container's simulated files: /etc/hostname, /etc/resolv.conf from the
pod's DNS config, /etc/hosts), ``pwd``, ``hostname``, ``env``,
``sysctl -n KEY`` (the pod's sysctls), ``pgrep NAME`` (the container's own
program is its only process), ``sh -c "a; b && c || d"`` chaining them,
and ``while true; do ...; done`` (a program that repeats its output every
period it sleeps). Anything else exits 127 with ``sh: NAME: not found``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shlex
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from backends.contract import ContainerRecord, ExecResult, SandboxRecord, errors
from backends.reference import BadReference, parse

PROGRAM_ANNOTATION = "fake.cri-shim.io/program"


@dataclasses.dataclass(frozen=True, slots=True)
class OutputLine:
    after: float  # seconds after start
    stream: str
    line: str


@dataclasses.dataclass(frozen=True, slots=True)
class Program:
    output: tuple[OutputLine, ...] = ()
    exit_code: int = 0
    exit_after: float | None = None  # None: runs until stopped
    ignore_sigterm: bool = False
    term_exit_code: int = 143  # 128 + SIGTERM, as a shell would report
    repeat_every: float | None = None  # the output is written again every this many seconds

    @property
    def finite(self) -> bool:
        return self.exit_after is not None


class ProgramError(ValueError):
    pass


def parse_program(data: Any, where: str) -> Program:
    if isinstance(data, str):
        try:
            data = json.loads(data)
        except ValueError as exc:
            raise ProgramError(f"{where}: not valid JSON: {exc}") from None
    if not isinstance(data, Mapping):
        raise ProgramError(f"{where}: expected an object")
    out: list[OutputLine] = []
    raw_output = data.get("output", [])
    if not isinstance(raw_output, list):
        raise ProgramError(f"{where}: output must be a list")
    for i, item in enumerate(raw_output):
        if isinstance(item, str):
            out.append(OutputLine(0.0, "stdout", item))
        elif isinstance(item, Mapping):
            stream = item.get("stream", "stdout")
            if stream not in ("stdout", "stderr"):
                raise ProgramError(f"{where}: output[{i}].stream must be stdout or stderr")
            out.append(OutputLine(float(item.get("after", 0.0)), stream, str(item.get("line", ""))))
        else:
            raise ProgramError(f"{where}: output[{i}] must be a string or an object")
    exit_after = data.get("exit_after")
    if exit_after is not None and (not isinstance(exit_after, (int, float)) or exit_after < 0):
        raise ProgramError(f"{where}: exit_after must be a non-negative number")
    try:
        return Program(
            output=tuple(sorted(out, key=lambda o: o.after)),
            exit_code=int(data.get("exit_code", 0)),
            exit_after=float(exit_after) if exit_after is not None else None,
            ignore_sigterm=bool(data.get("ignore_sigterm", False)),
            term_exit_code=int(data.get("term_exit_code", 143)),
            repeat_every=float(data["repeat_every"]) if data.get("repeat_every") else None,
        )
    except (TypeError, ValueError) as exc:
        raise ProgramError(f"{where}: {exc}") from None


# --------------------------------------------------------------------------- the tiny shell


@dataclasses.dataclass(frozen=True, slots=True)
class ShellContext:
    """What the built-ins can see of their container."""

    env: Mapping[str, str] = dataclasses.field(default_factory=dict)
    hostname: str = ""
    files: Mapping[str, str] = dataclasses.field(default_factory=dict)
    sysctls: Mapping[str, str] = dataclasses.field(default_factory=dict)
    processes: Sequence[str] = ()  # command names of the running processes


@dataclasses.dataclass(slots=True)
class ShellResult:
    stdout: bytes = b""
    stderr: bytes = b""
    exit_code: int = 0
    sleep: float = 0.0  # total time the commands take
    reads_stdin: bool = False  # `cat`: the caller copies stdin to stdout
    known: bool = True


def _split_statements(script: str) -> list[tuple[str, list[str]]]:
    """[(joiner, argv)], where joiner is ';', '&&' or '||' before the statement."""
    lex = shlex.shlex(script, posix=True, punctuation_chars=";&|>")
    lex.whitespace_split = True
    statements: list[tuple[str, list[str]]] = []
    joiner = ";"
    current: list[str] = []
    for tok in lex:
        if tok in (";", "&&", "||", "\n"):
            if current:
                statements.append((joiner, current))
            current = []
            joiner = tok if tok != "\n" else ";"
        else:
            current.append(tok)
    if current:
        statements.append((joiner, current))
    return statements


def _redirect(words: list[str]) -> tuple[list[str], str]:
    """Strips `>&2`, `1>&2`, `> /dev/stderr`, `> /dev/null`; returns (words, stdout|stderr|null)."""
    out: list[str] = []
    target = "stdout"
    i = 0
    while i < len(words):
        w = words[i]
        nxt = words[i + 1] if i + 1 < len(words) else ""
        if w in (">&", "1>&") and nxt == "2":
            target, i = "stderr", i + 2
            continue
        if w == ">" and nxt in ("/dev/stderr", "/dev/null", "/dev/stdout"):
            target, i = nxt.removeprefix("/dev/"), i + 2
            continue
        out.append(w)
        i += 1
    if out and out[-1] == "1" and target != "stdout":
        out.pop()  # the "1" of "1>&2", split off by the tokenizer
    return out, target


def run_shell(argv: Sequence[str], ctx: ShellContext | None = None) -> ShellResult:
    """Interprets argv as the built-ins do; never raises."""
    ctx = ctx or ShellContext()
    if not argv:
        return ShellResult(exit_code=0)
    if argv[0] in ("sh", "/bin/sh", "bash", "/bin/bash") and len(argv) >= 3 and argv[1] == "-c":
        try:
            statements = _split_statements(argv[2])
        except ValueError as exc:
            return ShellResult(stderr=f"sh: syntax error: {exc}\n".encode(), exit_code=2)
    else:
        statements = [(";", list(argv))]
    result = ShellResult()
    last = 0
    for joiner, words in statements:
        if joiner == "&&" and last != 0:
            continue
        if joiner == "||" and last == 0:
            continue
        words, target = _redirect(words)
        name = words[0].rsplit("/", 1)[-1] if words else "true"
        args = words[1:]
        if name == "echo" and target != "stdout":
            if target == "stderr":
                result.stderr += (" ".join(a for a in args if a != "-n") + "\n").encode()
            last = 0
        elif name == "echo":
            newline = True
            if args and args[0] == "-n":
                newline, args = False, args[1:]
            text = " ".join(args) + ("\n" if newline else "")
            result.stdout += text.encode()
            last = 0
        elif name == "true":
            last = 0
        elif name == "false":
            last = 1
        elif name == "exit":
            try:
                result.exit_code = int(args[0]) & 0xFF if args else last
            except ValueError:
                result.stderr += f"sh: exit: {args[0]}: numeric argument required\n".encode()
                result.exit_code = 2
            return result
        elif name == "sleep":
            try:
                result.sleep += float(args[0]) if args else 0.0
                last = 0
            except ValueError:
                result.stderr += f"sleep: invalid number '{args[0]}'\n".encode()
                last = 1
        elif name == "cat" and not args:
            result.reads_stdin = True
            last = 0
        elif name == "cat":
            last = 0
            for path in args:
                if path in ctx.files:
                    result.stdout += ctx.files[path].encode()
                else:
                    result.stderr += f"cat: can't open '{path}': No such file or directory\n".encode()
                    last = 1
        elif name == "sysctl" and len(args) == 2 and args[0] == "-n":
            if args[1] in ctx.sysctls:
                result.stdout += f"{ctx.sysctls[args[1]]}\n".encode()
                last = 0
            else:
                result.stderr += f"sysctl: error: '{args[1]}' is an unknown key\n".encode()
                last = 1
        elif name == "pgrep" and len(args) == 1:
            pids = [str(i + 1) for i, p in enumerate(ctx.processes) if args[0] in p]
            result.stdout += "".join(f"{p}\n" for p in pids).encode()
            last = 0 if pids else 1
        elif name == "pwd":
            result.stdout += b"/\n"
            last = 0
        elif name == "hostname":
            result.stdout += f"{ctx.hostname}\n".encode()
            last = 0
        elif name == "env":
            result.stdout += "".join(f"{k}={v}\n" for k, v in ctx.env.items()).encode()
            last = 0
        else:
            result.stderr += f"sh: {words[0]}: not found\n".encode()
            result.known = False
            last = 127
    result.exit_code = last
    return result


_LOOP_RE = re.compile(r"^\s*while\s+(?:true|:)\s*;\s*do\s+(?P<body>.*?);?\s*done\s*$", re.S)


def program_from_command(argv: Sequence[str], ctx: ShellContext | None = None) -> Program | None:
    """A program when the command is made only of built-ins, else None (run until stopped)."""
    if not argv:
        return None
    if len(argv) == 3 and argv[0] in ("sh", "/bin/sh") and argv[1] == "-c":
        loop = _LOOP_RE.match(argv[2])
        if loop:
            body = program_from_command(["sh", "-c", loop.group("body")], ctx)
            if body is None or not body.exit_after:
                return None  # a loop without a pause would only spin
            return dataclasses.replace(body, exit_after=None, repeat_every=body.exit_after)
    res = run_shell(argv, ctx)
    if not res.known or res.reads_stdin:
        return None
    lines: list[OutputLine] = []
    for stream, data in (("stdout", res.stdout), ("stderr", res.stderr)):
        text = data.decode(errors="replace")
        for line in text.splitlines():
            lines.append(OutputLine(0.0, stream, line))
    return Program(output=tuple(lines), exit_code=res.exit_code, exit_after=res.sleep)


# --------------------------------------------------------------------------- the handler's rules


class Programs:
    """The handler's ``programs`` table and ``exec`` rules, and which program a container runs."""

    def __init__(self, name: str, options: Mapping[str, Any]) -> None:
        self._programs: dict[str, Program] = {}
        self._exec_rules: list[tuple[list[str], ExecResult, float]] = []
        for image, prog in dict(options.get("programs", {})).items():
            self._programs[image] = parse_program(prog, f"[handlers.{name}.programs.{image}]")
        for i, rule in enumerate(options.get("exec", [])):
            cmd = rule.get("cmd")
            if not isinstance(cmd, list) or not cmd:
                raise ValueError(f"[handlers.{name}] exec[{i}].cmd must be a non-empty list")
            res = ExecResult(
                exit_code=int(rule.get("exit_code", 0)),
                stdout=str(rule.get("stdout", "")).encode(),
                stderr=str(rule.get("stderr", "")).encode(),
            )
            self.add_exec_rule([str(c) for c in cmd], res, float(rule.get("delay", 0.0)))

    def add_exec_rule(self, cmd: Sequence[str], result: ExecResult, delay: float = 0.0) -> None:
        self._exec_rules.append((list(cmd), result, delay))

    def program_for(self, c: ContainerRecord, ctx: Callable[[], ShellContext]) -> Program:
        """The annotation's program, else the table's for the image, else the command's, else the default."""
        raw = c.config.annotations.get(PROGRAM_ANNOTATION)
        if raw is not None:
            try:
                return parse_program(raw, f"annotation {PROGRAM_ANNOTATION}")
            except ProgramError as exc:
                raise errors.InvalidArgumentError(str(exc)) from None
        image = c.config.image.image
        prog = self._programs.get(image)
        if prog is None:
            try:
                ref = parse(image)
                prog = self._programs.get(ref.repository) or self._programs.get(ref.tagged)
            except BadReference:
                prog = None
        if prog is not None:
            return prog
        argv = list(c.config.command) + list(c.config.args)
        return program_from_command(argv, ctx()) or Program()

    def exec(self, cmd: Sequence[str], ctx: ShellContext) -> tuple[ExecResult, float]:
        """The first matching exec rule (a trailing "*" matches any rest), else the built-ins."""
        for rule_cmd, res, delay in self._exec_rules:
            if list(cmd) == rule_cmd or (
                rule_cmd[-1] == "*" and list(cmd[: len(rule_cmd) - 1]) == rule_cmd[:-1]
            ):
                return res, delay
        r = run_shell(cmd, ctx)
        return ExecResult(exit_code=r.exit_code, stdout=r.stdout, stderr=r.stderr), r.sleep


def shell_context(c: ContainerRecord, sb: SandboxRecord | None, running: bool) -> ShellContext:
    """What the built-ins see of container ``c`` in its sandbox ``sb`` (None: unknown to the runtime)."""
    hostname = (sb.config.hostname if sb else "") or c.sandbox_id[:12]
    files = {
        "/etc/hostname": hostname + "\n",
        "/etc/hosts": f"127.0.0.1\tlocalhost\n{sb.status.ip if sb else ''}\t{hostname}\n",
    }
    sysctls: dict[str, str] = {}
    if sb is not None:
        dns = sb.config.dns_config
        resolv = "".join(f"nameserver {s}\n" for s in dns.servers)
        if dns.searches:
            resolv += "search " + " ".join(dns.searches) + "\n"
        if dns.options:
            resolv += "options " + " ".join(dns.options) + "\n"
        files["/etc/resolv.conf"] = resolv
        sysctls = dict(sb.config.linux.sysctls)
        for key, value in sysctls.items():
            files["/proc/sys/" + key.replace(".", "/")] = value + "\n"
    argv = list(c.config.command) + list(c.config.args)
    processes = [os.path.basename(argv[0])] if argv and running else []
    env = {kv.key: kv.value.decode(errors="replace") for kv in c.config.envs}
    return ShellContext(env=env, hostname=hostname, files=files, sysctls=sysctls, processes=processes)
