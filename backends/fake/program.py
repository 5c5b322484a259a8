"""What a fake container "runs": scripted programs, the handler's exec rules.

A container runs (first match wins):

1. the program of its annotation ``fake.cri-shim.io/program``: JSON such as
   ``{"output": ["hello", {"after": 0.5, "stream": "stderr", "line": "oops"}],
   "exit_code": 3, "exit_after": 1.0, "ignore_sigterm": false}`` — output
   lines over time, then an exit with a code after a duration, or running
   until stopped;
2. the program of the handler's ``programs`` table, by image name or repository (as the
   config names it, else as the pod spec wrote it: ``user_specified_image``);
3. its command, in the built-in shell (:mod:`backends.fake.shell`), when the
   shell knows the command (``sh -c "..."``, ``sleep 3600``, ``cat`` ...);
4. otherwise (``nginx``, ``/pause``): nothing, until stopped.

ExecSync and exec answer from the handler's ``exec`` rules first, then run
the command in the built-in shell, over the container's files
(:mod:`backends.fake.files`).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from typing import Any

from backends.contract import ContainerRecord, ExecResult, errors
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

    def program_for(self, c: ContainerRecord) -> Program | None:
        """The annotation's program, else the table's for the image; None: the container runs its
        command (in the built-in shell when it knows it, else silently until stopped)."""
        raw = c.config.annotations.get(PROGRAM_ANNOTATION)
        if raw is not None:
            try:
                return parse_program(raw, f"annotation {PROGRAM_ANNOTATION}")
            except ProgramError as exc:
                raise errors.InvalidArgumentError(str(exc)) from None
        # The image as the config names it, else as the pod spec wrote it (the kubelet names
        # the image's ID, and the spec's name in user_specified_image).
        for image in (c.config.image.image, c.config.image.user_specified_image):
            prog = self._programs.get(image) if image else None
            if prog is None and image:
                try:
                    ref = parse(image)
                    prog = self._programs.get(ref.repository) or self._programs.get(ref.tagged)
                except BadReference:
                    prog = None
            if prog is not None:
                return prog
        return None

    def exec_rule(self, cmd: Sequence[str]) -> tuple[ExecResult, float] | None:
        """The first matching exec rule (a trailing "*" matches any rest) and its delay, if any."""
        for rule_cmd, res, delay in self._exec_rules:
            if list(cmd) == rule_cmd or (
                rule_cmd[-1] == "*" and list(cmd[: len(rule_cmd) - 1]) == rule_cmd[:-1]
            ):
                return res, delay
        return None
