# ruff: noqa: ASYNC240
# A stat of a state file just written is quick and bounded.
"""A QEMU VM's state saved to a file and a new QEMU started from it, through QMP.

The state is QEMU's migration stream written to a file. :func:`save` stops a running VM,
migrates it into the file and resumes it or leaves it stopped; a QEMU started with
:func:`incoming_args` waits for a stream, which :func:`restore` gives it, and runs the VM
from where it was saved. Both talk to the VM's QMP socket (``qmp.sock`` in its state
directory): QEMU's JSON monitor, one command and one answer at a time, events in between.

Whether the guest's RAM goes into the stream is the caller's choice:

- ``ignore_shared=True`` (the qemu driver's templates, ``qemu_template.py``): the guest's RAM
  is a shared file mapping, the ``x-ignore-shared`` capability leaves it out of the stream,
  which holds only the devices' state (a few MiB); the restored VM maps that same file
  privately (copy-on-write), so its RAM is the saved VM's with nothing copied;
- ``ignore_shared=False`` (a checkpoint of a running VM): the RAM is copied into the stream
  and the restored VM needs no file but it.

QEMU is confined (``qemu_confine.py``) and cannot open the state file itself: the file is
opened here and its descriptor handed over the QMP socket (``getfd``), and the stream is
``fd:NAME``. QEMU 7.2's monitor names its capabilities as its QAPI schema does:
``migrate-set-capabilities``, ``stop``, ``migrate``, ``query-migrate``, ``migrate-incoming``,
``query-status``, ``cont``.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import dataclasses
import json
import os
import socket
import time
from collections.abc import AsyncIterator
from typing import Any

from backends.runv.hypervisor import VM

QMP_SOCKET = "qmp.sock"  # in the VM's state directory
STATE_FD = "runv-state"  # the name the state file's descriptor gets in QEMU
POLL = 0.02


class SnapshotError(Exception):
    """A VM's state could not be saved or restored (QMP's or QEMU's own words)."""


def qmp_path(vm: VM) -> str:
    return os.path.join(vm.state_dir, QMP_SOCKET)


def qmp_args(vm: VM) -> list[str]:
    """QEMU's arguments for the VM's QMP socket."""
    return ["-qmp", f"unix:{qmp_path(vm)},server=on,wait=off"]


def incoming_args() -> list[str]:
    """QEMU's arguments for a VM that starts from a saved state: it waits for :func:`restore`."""
    return ["-incoming", "defer"]


class Qmp:
    """A QMP connection: ``execute`` one command at a time; events are kept, not answered."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._buf = b""
        self.events: list[dict[str, Any]] = []

    @classmethod
    async def connect(cls, path: str, timeout: float) -> Qmp:
        """Connect, read QEMU's greeting and leave capabilities negotiation (retried while the
        socket is not there yet, for ``timeout`` s)."""
        loop = asyncio.get_running_loop()
        deadline = time.monotonic() + timeout
        while True:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
            sock.setblocking(False)
            try:
                await loop.sock_connect(sock, path)
                break
            except (FileNotFoundError, ConnectionRefusedError) as exc:
                sock.close()
                if time.monotonic() > deadline:
                    raise SnapshotError(f"QMP socket {path}: {exc}") from exc
                await asyncio.sleep(POLL)
            except OSError as exc:
                sock.close()
                raise SnapshotError(f"QMP socket {path}: {exc}") from exc
        qmp = cls(sock)
        try:
            async with asyncio.timeout(max(1.0, deadline - time.monotonic())):
                greeting = await qmp._message()
                if "QMP" not in greeting:
                    raise SnapshotError(f"not a QMP greeting: {str(greeting)[:200]}")
                await qmp.execute("qmp_capabilities")
        except BaseException:
            qmp.close()
            raise
        return qmp

    def close(self) -> None:
        self._sock.close()

    async def execute(self, command: str, arguments: dict[str, Any] | None = None, fd: int = -1) -> Any:
        """``command``'s return value; SnapshotError with QEMU's words for an error. ``fd`` goes
        with the command (SCM_RIGHTS), as ``getfd`` wants it."""
        msg: dict[str, Any] = {"execute": command}
        if arguments:
            msg["arguments"] = arguments
        data = json.dumps(msg).encode() + b"\n"
        loop = asyncio.get_running_loop()
        if fd >= 0:
            # A short message on an idle socket: sent at once, else an error (no partial send).
            fds = array.array("i", [fd])
            sent = self._sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
            data = data[sent:]
        if data:
            await loop.sock_sendall(self._sock, data)
        while True:
            answer = await self._message()
            if "event" in answer:
                self.events.append(answer)
                continue
            if "error" in answer:
                err = answer["error"]
                desc = err.get("desc", err) if isinstance(err, dict) else err
                raise SnapshotError(f"QMP {command}: {desc}")
            if "return" in answer:
                return answer["return"]

    async def event(self, name: str, deadline: float, device: str = "") -> dict[str, Any]:
        """The next event ``name`` (about ``device``, when given), kept or yet to come; raises
        SnapshotError when none has come by ``deadline`` (time.monotonic)."""
        while True:
            for i, ev in enumerate(self.events):
                data = ev.get("data") or {}
                if ev.get("event") == name and (not device or data.get("device") == device):
                    del self.events[i]
                    return ev
            left = deadline - time.monotonic()
            if left <= 0:
                raise SnapshotError(f"QEMU sent no {name} event in time")
            try:
                async with asyncio.timeout(left):
                    msg = await self._message()
            except TimeoutError:
                continue
            if "event" in msg:
                self.events.append(msg)

    async def _message(self) -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        while b"\n" not in self._buf:
            chunk = await loop.sock_recv(self._sock, 65536)
            if not chunk:
                raise SnapshotError("QEMU closed its QMP socket")
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        try:
            obj = json.loads(line)
        except ValueError:
            raise SnapshotError(f"QMP: not JSON: {line[:200]!r}") from None
        if not isinstance(obj, dict):
            raise SnapshotError(f"QMP: not an object: {line[:200]!r}")
        return obj


@contextlib.asynccontextmanager
async def qmp_of(vm: VM, timeout: float) -> AsyncIterator[Qmp]:
    qmp = await Qmp.connect(qmp_path(vm), timeout)
    try:
        yield qmp
    finally:
        qmp.close()


async def _ignore_shared(qmp: Qmp, on: bool) -> None:
    caps = [{"capability": "x-ignore-shared", "state": on}]
    await qmp.execute("migrate-set-capabilities", {"capabilities": caps})


async def _migrated(qmp: Qmp, deadline: float) -> dict[str, Any]:
    """query-migrate's answer once the migration has ended (raises if it failed)."""
    while True:
        info = await qmp.execute("query-migrate")
        status = info.get("status", "") if isinstance(info, dict) else ""
        if status == "completed":
            return dict(info)
        if status in ("failed", "cancelled"):
            raise SnapshotError(f"migration {status}: {info.get('error-desc', '')}".strip(": "))
        if time.monotonic() > deadline:
            raise SnapshotError(f"migration not done in time (status {status or 'unknown'})")
        await asyncio.sleep(POLL)


async def save(vm: VM, path: str, *, resume: bool, ignore_shared: bool = False, timeout: float = 60.0) -> int:
    """Stop ``vm``, write its state to ``path`` (made whole or not at all) and, with ``resume``,
    run it again; return the state's size in bytes. With ``ignore_shared``, guest RAM in a
    shared file mapping is left out (see the module's docstring).

    On failure ``path`` is not there and the VM is resumed if ``resume`` (else left stopped);
    raises SnapshotError."""
    deadline = time.monotonic() + timeout
    tmp = path + ".tmp"
    async with qmp_of(vm, timeout) as qmp:
        try:
            await _ignore_shared(qmp, ignore_shared)
            await qmp.execute("stop")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            try:
                await qmp.execute("getfd", {"fdname": STATE_FD}, fd=fd)
            finally:
                os.close(fd)
            await qmp.execute("migrate", {"uri": f"fd:{STATE_FD}"})
            await _migrated(qmp, deadline)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            if resume:
                with contextlib.suppress(SnapshotError, OSError):
                    await qmp.execute("cont")
            raise
        if resume:
            await qmp.execute("cont")
    return os.path.getsize(path)


async def restore(vm: VM, path: str, *, ignore_shared: bool = False, timeout: float = 60.0) -> None:
    """Load the state in ``path`` into ``vm``'s QEMU, started with :func:`incoming_args` (and,
    with ``ignore_shared``, the saved VM's RAM mapped), and run it. Raises SnapshotError (QEMU
    itself exits when a stream it has begun to load is bad)."""
    deadline = time.monotonic() + timeout
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        raise SnapshotError(f"state file {path}: {exc.strerror}") from exc
    try:
        async with qmp_of(vm, timeout) as qmp:
            await _ignore_shared(qmp, ignore_shared)
            await qmp.execute("getfd", {"fdname": STATE_FD}, fd=fd)
            os.close(fd)
            fd = -1
            await qmp.execute("migrate-incoming", {"uri": f"fd:{STATE_FD}"})
            while True:
                status = await qmp.execute("query-status")
                state = status.get("status", "") if isinstance(status, dict) else ""
                if state == "running":
                    return
                if state == "paused":  # loaded: a VM saved stopped comes back stopped
                    await qmp.execute("cont")
                    continue
                if state not in ("inmigrate", "prelaunch", "restore-vm"):
                    raise SnapshotError(f"the VM is {state or 'in no known state'} after loading {path}")
                if time.monotonic() > deadline:
                    raise SnapshotError(f"the state in {path} was not loaded in {timeout:g}s ({state})")
                await asyncio.sleep(POLL)
    finally:
        if fd >= 0:
            os.close(fd)


@dataclasses.dataclass(frozen=True, slots=True)
class GuestMemory:
    """The guest's RAM as a mapping of the file ``path`` (a descriptor QEMU inherited:
    ``/proc/self/fd/N``): ``share``, written through to the file (the VM saved with
    ``ignore_shared``), else private, copy-on-write (a VM restored from that file)."""

    path: str
    share: bool
    id: str = "ram"

    def args(self, size_mib: int) -> list[str]:
        share = "on" if self.share else "off"
        return [
            "-object",
            f"memory-backend-file,id={self.id},size={size_mib}M,mem-path={self.path},share={share}",
        ]
