"""The stub driver's side of its VM template (``template_server.py``): start it, ask it for VMs.

One template process per driver, started on first use and again if it has died,
ended with the driver (its input closes: a shim killed outright ends it too).
Requests go one at a time: the template answers each as soon as it has forked,
a few milliseconds, so boots still overlap.
"""

from __future__ import annotations

import asyncio
import json
import os
from typing import Any

from backends.linux import procfs
from backends.runv.drivers.base import end_helper


class TemplateError(Exception):
    """The template could not clone a VM; ``started`` says whether it had ever come up."""

    def __init__(self, message: str, started: bool) -> None:
        super().__init__(message)
        self.started = started


class Template:
    START_TIMEOUT = 60.0  # imports on a loaded node
    TIMEOUT = 10.0

    def __init__(self, python: str, env: dict[str, str]) -> None:
        self.python = python
        self.env = env
        self.pid = 0  # of the running template, 0 if none
        self._proc: asyncio.subprocess.Process | None = None
        self._lock = asyncio.Lock()

    async def clone(self, procs: list[str], console: str, own_net: bool, argv: list[str]) -> int:
        """A new VM process, its PID; raises TemplateError."""
        request = json.dumps({"procs": procs, "console": console, "net": own_net, "argv": argv}).encode()
        async with self._lock:
            proc = await self._running()
            assert proc.stdin is not None
            try:
                proc.stdin.write(request + b"\n")
                await proc.stdin.drain()
                answer = await self._line(proc, self.TIMEOUT)
            except (ConnectionError, TimeoutError) as exc:
                await self.close()
                raise TemplateError(f"the template did not answer: {exc or 'timeout'}", True) from exc
            if not answer:
                await self.close()
                raise TemplateError("the template died", True)
            pid = answer.get("pid")
            if not isinstance(pid, int) or pid <= 0:
                raise TemplateError(f"the template refused: {answer.get('error', answer)}", True)
            return pid

    async def start(self) -> None:
        """Have the template running (raises TemplateError if it cannot start)."""
        async with self._lock:
            await self._running()

    async def _running(self) -> asyncio.subprocess.Process:
        if self._proc is not None and self._proc.returncode is None and _lives(self._proc.pid):
            return self._proc
        if self._proc is not None:
            await self.close()
        self.pid = 0
        try:
            proc = await asyncio.create_subprocess_exec(
                self.python,
                "-m",
                "backends.runv.drivers.template_server",
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.DEVNULL,
                env=self.env,
            )
        except OSError as exc:
            raise TemplateError(f"cannot start the template: {exc}", False) from exc
        self._proc = proc  # from here, close() ends it, also while it is getting ready
        try:
            ready = await self._line(proc, self.START_TIMEOUT)
        except TimeoutError:
            ready = {"error": f"not ready within {self.START_TIMEOUT:g}s"}
        if not isinstance(ready.get("ready"), int):
            await self.close()
            raise TemplateError(f"the template cannot start: {ready.get('error', 'it exited')}", False)
        self.pid = proc.pid
        return proc

    @staticmethod
    async def _line(proc: asyncio.subprocess.Process, timeout: float) -> dict[str, Any]:
        """The next answer ({} when the template has exited)."""
        assert proc.stdout is not None
        async with asyncio.timeout(timeout):
            line = await proc.stdout.readline()
        try:
            obj = json.loads(line) if line else {}
        except ValueError:
            obj = {"error": f"a bad answer: {line[:200]!r}"}
        return obj if isinstance(obj, dict) else {"error": "a bad answer"}

    async def close(self) -> None:
        """End the template (its VMs keep running)."""
        proc, self._proc = self._proc, None
        self.pid = 0
        if proc is not None:
            await end_helper(proc)


def _lives(pid: int) -> bool:
    """Whether the template process is still there: asyncio sets its returncode a little after
    it is reaped, and a request sent to it meanwhile would be lost."""
    st = procfs.stat(pid)
    return st is not None and st.state not in ("Z", "X")


def template_env(package_root: str) -> dict[str, str]:
    """The shim's environment, with the agent's code importable (as the unshare path gives the agent)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH", "")) if p)
    return env
