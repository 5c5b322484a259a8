"""The caller's side of a run: what it gives the shell (:class:`ShellIO`), what an extra command is
(:data:`Command`), and the network a server in the shell listens on (:class:`Network`)."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Protocol, TypeAlias

from backends.fake.shell.fs import Fs

Command: TypeAlias = Callable[[list[str], "ShellIO"], Awaitable[int]]
"""An extra command: ``await cmd(argv, io)`` gives its exit status (see :mod:`backends.fake.shell`)."""


class Connection(Protocol):
    """One accepted TCP connection: bytes from the client (b"" at its end), bytes back to it."""

    async def read(self) -> bytes: ...

    async def write(self, data: bytes) -> None: ...


Serve: TypeAlias = Callable[[Connection], Awaitable[None]]
"""What a listening server does with each connection it accepts; returning closes the connection."""


class Network(Protocol):
    """The container's network, as far as a server in the shell needs one: its ports."""

    def listen(self, host: str, port: int, serve: Serve) -> Callable[[], None]:
        """Serves ``port`` with ``serve`` until the returned close is called (or the container ends);
        OSError as bind(2) fails: EADDRINUSE when something of the pod listens there already."""
        ...


# Linux capabilities a container's processes get unless privileged or told otherwise: the
# runtimes' (containerd's, CRI-O's) default set, without the CAP_ prefix.
DEFAULT_CAPABILITIES = frozenset(
    "CHOWN DAC_OVERRIDE FSETID FOWNER MKNOD NET_RAW SETGID SETUID SETFCAP SETPCAP NET_BIND_SERVICE"
    " SYS_CHROOT KILL AUDIT_WRITE".split()
)


@dataclasses.dataclass(frozen=True, slots=True)
class Privileges:
    """Who a container's processes run as and what its security context lets them do: what `id`,
    a setuid program (nonewprivs' ``nnp``) and a privileged command (``ip link add``) depend on."""

    uid: int = 0
    gid: int = 0
    groups: tuple[int, ...] = ()  # supplementary
    capabilities: frozenset[str] = DEFAULT_CAPABILITIES  # "ALL" in it: every one (privileged)
    no_new_privs: bool = False  # a setuid program keeps the caller's uid

    def can(self, capability: str) -> bool:
        return "ALL" in self.capabilities or capability in self.capabilities


@dataclasses.dataclass
class ShellIO:
    """Everything a shell run touches of its container; the shell itself has no other way out."""

    fs: Fs
    env: dict[str, str]  # the container's environment (PATH, HOSTNAME, user variables)
    hostname: str = "localhost"
    cwd: str = "/"
    stdin: Callable[[], Awaitable[bytes]] | None = None  # b"" at end of input; None: no stdin
    stdout: Callable[[bytes], Awaitable[None]] = dataclasses.field(kw_only=True)
    stderr: Callable[[bytes], Awaitable[None]] = dataclasses.field(kw_only=True)
    term: asyncio.Event | None = None  # set by the caller to deliver term_signal; the shell clears it
    term_signal: str = "TERM"  # what setting ``term`` delivers: the container's stop signal
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep  # injectable, for tests
    commands: Mapping[str, Command] = dataclasses.field(default_factory=dict)
    pid: int = 1  # $$; `kill $$` (or `kill 1` when this is PID 1) signals the shell itself
    # The main shell is PID 1 of its PID namespace (a container's own): a signal it has no trap for
    # is ignored, but the caller's KILL (its stop timeout); False: the default actions apply.
    init: bool = False
    # Signals `kill` sent to the main shell, oldest first: its jobs' `kill $$`, and an exec's `kill 1`
    # the caller queues here before setting ``term``.
    sent: list[str] = dataclasses.field(default_factory=list)
    kill_init: Callable[[str], None] | None = None  # `kill SIG 1` from this run (an exec): to PID 1
    # PID 1's stdout and stderr (the container's log), which /proc/1/fd/1 and 2 name: lifecycle
    # hooks and execs write `echo ... > /proc/1/fd/1` to reach the log. None: no such process.
    init_output: Callable[[int], Callable[[bytes], Awaitable[None]] | None] | None = None
    # (PID, command name) of the processes its PID namespace holds, for ps, pgrep and pidof.
    processes: Callable[[], list[tuple[int, str]]] | None = None
    clock: Callable[[], float] = time.time  # seconds since the epoch, for date
    # A command not found runs, silently, until stopped (a container's own program the fake cannot
    # run: `sh -c "prepare; nginx"`), instead of failing with 127 as an exec's does.
    unknown_runs: bool = False
    network: Network | None = None  # None: no network (a server cannot listen)
    privileges: Privileges = Privileges()  # root with the default capabilities
