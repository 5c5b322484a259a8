"""Running one CNI plugin: found on the plugin path, parameters in CNI_*, config on stdin.

The plugin inherits the runtime's environment (it may run ``iptables`` and the like from PATH)
less any CNI_* of ours, and runs in a session of its own, so that a timeout or a cancelled call
kills it together with the delegated plugins it started. A non-zero exit is read as the spec's
error object (``code``, ``msg``, ``details``) from stdout, or stderr; without one, stderr says
what went wrong.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
from collections.abc import Mapping, Sequence
from typing import Any

from backends.cni.errors import PluginError, PluginNotFoundError, PluginTimeoutError

_STDERR_TAIL = 2000  # bytes of an unstructured failure's stderr kept in the error


def find_plugin(plugin: str, dirs: Sequence[str]) -> str:
    for d in dirs:
        path = os.path.join(d, plugin)
        if os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    raise PluginNotFoundError(plugin, dirs)


@dataclasses.dataclass(frozen=True, slots=True)
class Invocation:
    """The CNI_* parameters of one command; empty ones are not set (STATUS and GC have none)."""

    command: str
    container_id: str = ""
    netns: str = ""
    ifname: str = ""
    args: str = ""

    def environ(self, dirs: Sequence[str]) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("CNI_")}
        params = {
            "CNI_COMMAND": self.command,
            "CNI_CONTAINERID": self.container_id,
            "CNI_NETNS": self.netns,
            "CNI_IFNAME": self.ifname,
            "CNI_ARGS": self.args,
            "CNI_PATH": os.pathsep.join(dirs),
        }
        env.update({k: v for k, v in params.items() if v})
        return env


def _failure(plugin: str, command: str, returncode: int, stdout: bytes, stderr: bytes) -> PluginError:
    for stream in (stdout, stderr):
        try:
            obj = json.loads(stream)
        except ValueError:
            continue
        if isinstance(obj, dict) and ("code" in obj or "msg" in obj):
            code = obj.get("code")
            return PluginError(
                plugin,
                command,
                code if isinstance(code, int) else 0,
                str(obj.get("msg", "")),
                str(obj.get("details", "")),
            )
    text = stderr[-_STDERR_TAIL:].decode(errors="replace").strip()
    return PluginError(plugin, command, 0, f"exit status {returncode}", text)


def _kill_session(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


async def run_plugin(
    plugin: str,
    dirs: Sequence[str],
    invocation: Invocation,
    config: Mapping[str, Any],
    timeout: float,
) -> bytes:
    """The plugin's stdout on success; PluginError, PluginTimeoutError or PluginNotFoundError."""
    path = find_plugin(plugin, dirs)
    proc = await asyncio.create_subprocess_exec(
        path,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=invocation.environ(dirs),
        start_new_session=True,
    )
    done = False
    try:
        async with asyncio.timeout(timeout):
            stdout, stderr = await proc.communicate(json.dumps(config).encode())
        done = True
    except TimeoutError:
        raise PluginTimeoutError(plugin, invocation.command, timeout) from None
    finally:
        if not done:
            # Timed out or cancelled: the plugin and whatever it started go, and are reaped.
            _kill_session(proc.pid)
            await proc.wait()
    if proc.returncode:
        raise _failure(plugin, invocation.command, proc.returncode, stdout, stderr)
    return stdout
