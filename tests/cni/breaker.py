"""An ADD that breaks, for the backends' tests on a real network: a fake plugin ``breaker`` chained
after the network's own refuses it, hangs until the plugin timeout, or hangs until the caller
gives up. What a backend must leave after each is the test's to check."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import pytest

from backends.cni import PluginError, PluginTimeoutError
from backends.contract.errors import DeadlineExceededError
from tests.cni import fakeplugin
from tests.cni.realnet import Net
from tests.criutil import until

HOWS = ("fails", "hangs", "given-up")
TIMEOUT = 3  # the plugin_timeout the backend is to be given


def break_add(net: Net, how: str) -> Path:
    """Write the network's conflist with ``breaker`` last; the file a hanging one puts its PIDs in."""
    fakeplugin.install(net.bin_dir, "breaker")
    pids = net.root / "pids"
    action = {"error": {"code": 7, "msg": "refused"}} if how == "fails" else {"hang": str(pids)}
    net.write_conflist({"type": "breaker", "fake": {"ADD": action}})
    return pids


async def run_broken(run: Coroutine[Any, Any, object], how: str, pids: Path) -> None:
    """Await ``run`` (a RunPodSandbox) and check it broke as ``how`` says: the plugin's name, code
    and message; killed at the timeout as DEADLINE_EXCEEDED; cancelled while the plugin ran.
    No plugin process is left."""
    if how == "fails":
        with pytest.raises(PluginError, match=r"breaker ADD failed \(code 7\): refused"):
            await run
        return
    if how == "hangs":
        with pytest.raises(PluginTimeoutError, match=f"breaker ADD did not finish in {TIMEOUT}s") as info:
            await run
        assert isinstance(info.value, DeadlineExceededError)
    else:
        task = asyncio.ensure_future(run)
        await until(lambda: pids.exists() and bool(pids.read_text()), 20)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    assert not any(fakeplugin.alive(int(pid)) for pid in pids.read_text().split())


async def wait_hung(pids: Path, call: asyncio.Future[Any], seconds: float = 30) -> None:
    """Until the hanging plugin has written its PIDs, ``call`` (that waits for it) not done."""
    deadline = time.monotonic() + seconds
    while not (pids.exists() and pids.read_text()):
        assert time.monotonic() < deadline and not call.done()
        await asyncio.sleep(0.05)


def kill_hung(pids: Path) -> None:
    """SIGKILL the hanging plugin and its child: in a session of their own, they outlive a runtime
    that was killed."""
    for pid in pids.read_text().split():
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid), signal.SIGKILL)
