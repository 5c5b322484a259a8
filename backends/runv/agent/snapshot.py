# ruff: noqa: ASYNC240
# The agent owns its VM: a mount-point check is a local, bounded call.
"""The guest's side of a VM whose state is saved and restored (the qemu driver's templates).

- ``before_save``: the VM's shares are unmounted. QEMU refuses to migrate a VM while a 9p
  export is mounted in its guest, and a VM started from the saved state has an export of its
  own (same tag, another host directory), so none may be mounted when the state is saved. (On
  virtio-fs the host then unplugs the device: QEMU 7.2 cannot migrate it.)
- ``restored``: a VM started from a saved state is a copy of the one saved, down to its
  kernel's random state, clock and MAC address; it is made its own: the host's fresh entropy
  is credited to the kernel's pool and the generators reseeded (the agent's own ``random``
  too), the clock set to the host's, the NIC given the VM's MAC, its shares mounted: over 9p,
  or over virtio-fs once the kernel has found the device the host has just plugged in (ACPI
  PCI hot-plug: tried again until it has, for ``VIRTIOFS_WAIT`` s).

What a copy keeps of the saved guest: the stack canaries and hash seeds of the processes
running when it was saved (its init and this agent), and the kernel's boot-time
randomisation (KASLR); processes started later (containers) draw from the reseeded kernel.
"""

from __future__ import annotations

import asyncio
import base64
import ctypes
import dataclasses
import errno
import fcntl
import os
import random
import socket
import struct
import time

from backends.runv.agent.guest import Guest
from backends.runv.agent.messages import Empty, Request
from backends.runv.agent.protocol import AgentError

# Mounted as /init mounts the VM's export at boot (backends/runv/guest_image.py).
NINEP_TAG = "shares"
NINEP_OPTIONS = "trans=virtio,version=9p2000.L,msize=262144,cache=none,access=any"
VIRTIOFS_WAIT = 25.0  # seconds for a hot-plugged virtio-fs device to be found (the host waits 30)
SHAREFS = ("9p", "virtiofs")

RNDADDENTROPY = 0x40085203  # _IOW('R', 0x03, int[2]): add bytes and credit them
RNDRESEEDCRNG = 0x5207  # _IO('R', 0x07): reseed the generators from the pool now
SIOCSIFHWADDR = 0x8924
ARPHRD_ETHER = 1


@dataclasses.dataclass(frozen=True, slots=True)
class SaveRequest(Request[Empty]):
    """Get the guest ready for its state to be saved."""

    OP = "before_save"
    RESULT = Empty
    shares: str = ""  # where the VM's export is mounted ("": none to unmount)


@dataclasses.dataclass(frozen=True, slots=True)
class RestoredRequest(Request[Empty]):
    """Make a guest started from a saved state its own."""

    OP = "restored"
    RESULT = Empty
    entropy: str  # base64, from the host's generator: at least 32 bytes
    time_ns: int  # the host's CLOCK_REALTIME when it sent this
    mac: str = ""  # the NIC's address ("": unchanged)
    interface: str = "eth0"
    shares: str = ""  # where to mount the VM's export ("": not mounted)
    sharefs: str = "9p"  # its transport: "9p" or "virtiofs" (its device just hot-plugged)


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


async def before_save(g: Guest, req: SaveRequest) -> Empty:
    if req.shares and os.path.ismount(req.shares):
        if _libc().umount2(req.shares.encode(), 0) != 0:
            err = ctypes.get_errno()
            raise AgentError("failed", f"cannot unmount {req.shares}: {os.strerror(err)}")
    return Empty()


async def restored(g: Guest, req: RestoredRequest) -> Empty:
    if req.sharefs not in SHAREFS:
        raise AgentError("invalid", f"sharefs: {req.sharefs!r} is not 9p or virtiofs")
    try:
        seed = base64.b64decode(req.entropy, validate=True)
    except ValueError:
        raise AgentError("invalid", "entropy: not base64") from None
    if len(seed) < 32:
        raise AgentError("invalid", f"entropy: {len(seed)} bytes, at least 32 wanted")
    try:
        _credit(seed)
        random.seed()  # from the reseeded kernel
        time.clock_settime_ns(time.CLOCK_REALTIME, req.time_ns)
    except OSError as exc:
        raise AgentError("failed", f"new identity: {exc}") from None
    if req.mac:
        _set_mac(req.interface, req.mac)
    if req.shares:
        os.makedirs(req.shares, exist_ok=True)
        if not os.path.ismount(req.shares):
            await _mount_shares(req.shares, req.sharefs)
    print(f"runv-agent: restored at {time.time():.3f}", flush=True)
    return Empty()


async def _mount_shares(where: str, sharefs: str) -> None:
    libc = _libc()
    if sharefs == "9p":
        if libc.mount(NINEP_TAG.encode(), where.encode(), b"9p", 0, NINEP_OPTIONS.encode()) != 0:
            err = ctypes.get_errno()
            raise AgentError("failed", f"cannot mount the shares on {where}: {os.strerror(err)}")
        return
    # The tag is unknown (EINVAL) until the kernel has probed the hot-plugged device.
    deadline = time.monotonic() + VIRTIOFS_WAIT
    while libc.mount(NINEP_TAG.encode(), where.encode(), b"virtiofs", 0, None) != 0:
        err = ctypes.get_errno()
        if err not in (errno.EINVAL, errno.ENOENT, errno.ENODEV) or time.monotonic() > deadline:
            raise AgentError("failed", f"cannot mount the virtio-fs shares on {where}: {os.strerror(err)}")
        await asyncio.sleep(0.02)


def _credit(seed: bytes) -> None:
    """Mix ``seed`` into the kernel's input pool, credited in full, and reseed its generators
    from it: until then they are the saved guest's, and every copy's the same."""
    info = struct.pack("ii", len(seed) * 8, len(seed)) + seed
    fd = os.open("/dev/urandom", os.O_WRONLY | os.O_CLOEXEC)
    try:
        fcntl.ioctl(fd, RNDADDENTROPY, info)
        fcntl.ioctl(fd, RNDRESEEDCRNG)
    finally:
        os.close(fd)


def _set_mac(interface: str, mac: str) -> None:
    try:
        addr = bytes(int(part, 16) for part in mac.split(":"))
    except ValueError:
        addr = b""
    if len(addr) != 6:
        raise AgentError("invalid", f"mac: {mac!r} is not a MAC address")
    ifreq = struct.pack("16sH6s", interface.encode(), ARPHRD_ETHER, addr).ljust(40, b"\0")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            fcntl.ioctl(s.fileno(), SIOCSIFHWADDR, ifreq)
        except OSError as exc:
            raise AgentError("failed", f"cannot set the MAC of {interface}: {exc.strerror}") from None
