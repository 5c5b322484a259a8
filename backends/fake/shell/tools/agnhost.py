"""agnhost: the Kubernetes e2e test image's multi-tool, as far as the node e2e specs observe it.

The suite's containers run ``registry.k8s.io/e2e-test-images/agnhost`` (ENTRYPOINT ``/agnhost``,
CMD ``pause``; ``/agnhost-2`` is a link to it) with a subcommand. Each one here prints what the
real one prints, in its words (the specs match its lines), over the container's files and ports:

- ``mounttest``: the file-system prober of the volume specs (flags below, in agnhost's order);
- ``entrypoint-tester``: prints its whole argv as Go prints a slice, ``[/agnhost entrypoint-tester a b]``;
- ``pause``: prints ``Paused`` and ``Signals registered``, waits for SIGINT or SIGTERM (it handles both,
  also as PID 1), writes ``exiting because of signal "terminated"`` to $TERMINATION_MESSAGE_PATH
  (default /dev/termination-log) and stdout, and exits 2 (1 for SIGINT);
- ``etc-hosts``, ``dns-suffix``, ``dns-server-list``: /etc/hosts, and resolv.conf's search list and
  servers, comma-joined;
- the servers ``netexec``, ``liveness``, ``test-webserver``, ``serve-hostname``
  (:mod:`.agnhost_servers`), on the pod's ports as the shell's ``httpd``.

Flags are cobra's: ``--name=value`` or ``--name value``, booleans bare or ``=false``. An unknown
subcommand or flag fails as cobra does (``Error: ...``, exit 1). A subcommand agnhost has and this
one does not (``porter``, ``grpc-health-checking``...) runs silently until stopped in a container's
command (as any program the fake cannot run) and fails with a message in an exec.

mounttest: ``--fs_type P`` (``mount type of "P": tmpfs``, else statfs's number), ``--new_file_0644``
/ ``0666`` / ``0660`` / ``0777 P`` (writes ``mount-tester new file`` with that mode, umask 0, then
prints it), ``--file_mode P`` (Go's FileMode, ``-rw-r--r--``, ``dgtrwxrwxrwx``), ``--file_perm P``
(its permission bits alone), ``--file_owner P`` (UID and GID), ``--file_content P`` and
``--file_content_in_loop P`` (every 2 s for ``--retry_time`` s, until the content is the new-file
text unless ``--break_on_expected_content=false``). Any failure prints agnhost's line and makes
the exit 1 once the rest has run. Ownership is the host's for a volume (the files the kubelet
made), root's for the container's own files.
"""

from __future__ import annotations

import stat
from collections.abc import Awaitable, Callable
from typing import TypeVar

from backends.fake.shell.control import ToolError
from backends.fake.shell.evaluation import Builtin, Shell
from backends.fake.shell.fs import TMPFS_MAGIC
from backends.fake.shell.streams import dec
from backends.fake.shell.tools import agnhost_servers
from backends.fake.shell.tools.agnhost_flags import (
    Flags,
    FlagValue,
    go_error,
    go_quote,
    parse_flags,
    wait_for_signal,
)

T = TypeVar("T")

NEW_FILE_CONTENT = "mount-tester new file\n"

# Subcommands of agnhost 2.56 that are not simulated here.
NOT_SIMULATED = frozenset(
    {
        "audit-proxy",
        "connect",
        "crd-conversion-webhook",
        "fake-gitserver",
        "fake-registry-server",
        "grpc-health-checking",
        "guestbook",
        "inclusterclient",
        "logs-generator",
        "net",
        "nettest",
        "no-snat-test",
        "no-snat-test-proxy",
        "porter",
        "port-forward-tester",
        "resource-consumer-controller",
        "tcp-reset",
        "webhook",
        "test-service-account-issuer-discovery",
        "stress",
        "podcertificatesigner",
    }
)

# Go's os.FileMode letters, in the order it prints them (d a l T L D p S u g c t ?), from st_mode.
_TYPE_LETTERS: tuple[tuple[str, Callable[[int], bool]], ...] = (
    ("d", stat.S_ISDIR),
    ("L", stat.S_ISLNK),
    ("D", lambda m: stat.S_ISBLK(m) or stat.S_ISCHR(m)),
    ("p", stat.S_ISFIFO),
    ("S", stat.S_ISSOCK),
    ("u", lambda m: bool(m & stat.S_ISUID)),
    ("g", lambda m: bool(m & stat.S_ISGID)),
    ("c", stat.S_ISCHR),
    ("t", lambda m: bool(m & stat.S_ISVTX)),
)


def go_file_mode(mode: int, perm_only: bool = False) -> str:
    """st_mode as Go's ``os.FileMode.String()`` prints it (``-rw-r--r--``, ``dgtrwxrwxrwx``);
    ``perm_only``: ``FileMode.Perm()``'s, the nine permission bits alone."""
    kind = "" if perm_only else "".join(letter for letter, test in _TYPE_LETTERS if test(mode))
    bits = "".join(c if mode & (1 << (8 - i)) else "-" for i, c in enumerate("rwxrwxrwx"))
    return (kind or "-") + bits


class _Mounttest:
    """One mounttest run: its checks in agnhost's order, each printing and noting a failure."""

    def __init__(self, sh: Shell, flags: Flags) -> None:
        self.sh = sh
        self.flags = flags
        self.failed = False

    async def say(self, line: str) -> None:
        await self.sh.out(line + "\n")

    async def fail(self, line: str) -> None:
        await self.say(line)
        self.failed = True

    async def run(self) -> int:
        f = self.flags
        await self.fs_type(f.text("fs_type"))
        for perm in (0o644, 0o666, 0o660, 0o777):
            await self.new_file(f.text(f"new_file_{perm:04o}"), perm)
        await self.mode(f.text("file_mode"), "mode of file", perm_only=False)
        await self.mode(f.text("file_perm"), "perms of file", perm_only=True)
        await self.owner(f.text("file_owner"))
        await self.content(f.text("file_content"))
        await self.content_in_loop(
            f.text("file_content_in_loop"), f.integer("retry_time"), f.boolean("break_on_expected_content")
        )
        return 1 if self.failed else 0

    def path(self, name: str) -> str:
        return self.sh.abspath(name)

    async def look(self, name: str, call: Callable[[str], T], error: str) -> T | None:
        """``call`` on the path of ``name``. None when ``name`` is empty (the check was not asked
        for), or when it raises OSError, which is printed after ``error`` as Go prints it (and
        fails the run)."""
        if not name:
            return None
        try:
            return call(self.path(name))
        except OSError as exc:
            await self.fail(f"{error}: {go_error(exc)}")
            return None

    async def fs_type(self, name: str) -> None:
        kind = await self.look(name, self.sh.io.fs.fs_type, f"error from statfs({go_quote(name)})")
        if kind is not None:
            await self.say(f"mount type of {go_quote(name)}: {'tmpfs' if kind == TMPFS_MAGIC else kind}")

    async def new_file(self, name: str, perm: int) -> None:
        if not name:
            return
        fs, path = self.sh.io.fs, self.path(name)
        try:
            new = not fs.exists(path)
            fs.write(path, NEW_FILE_CONTENT.encode())
            if new:  # os.WriteFile's perm applies to a file it creates (umask 0)
                fs.chmod(path, perm)
        except OSError as exc:
            await self.fail(f"error writing new file {go_quote(name)}: open {name}: {go_error(exc)}")
            return
        await self.content(name)

    async def mode(self, name: str, what: str, perm_only: bool) -> None:
        st = await self.look(name, self.sh.io.fs.stat, f"error from Stat({go_quote(name)}): stat {name}")
        if st is not None:
            await self.say(f"{what} {go_quote(name)}: {go_file_mode(st.mode, perm_only)}")

    async def owner(self, name: str) -> None:
        st = await self.look(name, self.sh.io.fs.stat, f"error from stat({go_quote(name)})")
        if st is not None:
            await self.say(f"owner UID of {go_quote(name)}: {st.uid}")
            await self.say(f"owner GID of {go_quote(name)}: {st.gid}")

    async def read(self, name: str) -> str:
        try:
            return dec(self.sh.io.fs.read(self.path(name)))
        except OSError as exc:
            raise OSError(exc.errno, f"open {name}: {go_error(exc)}") from None

    async def content(self, name: str) -> None:
        if not name:
            return
        try:
            text = await self.read(name)
        except OSError as exc:
            await self.fail(f"error reading file content for {go_quote(name)}: {exc.strerror}")
            return
        await self.say(f"content of file {go_quote(name)}: {text}")

    async def content_in_loop(self, name: str, retry_seconds: int, break_on_expected: bool) -> None:
        """Reads every 2 s while under ``retry_seconds`` (counted in the sleeps it made, on the
        shell's clock of sleeps); the last read's error, if any, is the result."""
        if not name:
            return
        elapsed, error = 0.0, ""
        while elapsed < retry_seconds:
            try:
                text = await self.read(name)
                error = ""
            except OSError as exc:
                error = exc.strerror or ""
                await self.say(f"Error reading file {name}: {error}, retrying")
            else:
                await self.say(f"content of file {go_quote(name)}: {text}")
                if not break_on_expected:
                    pass
                elif text != NEW_FILE_CONTENT:
                    await self.say(f"Unexpected content. Expected: {NEW_FILE_CONTENT}. Retrying")
                else:
                    break
            await self.sh.block(self.sh.io.sleep(2.0))
            elapsed += 2.0
        if error:
            self.failed = True


MOUNTTEST_FLAGS: dict[str, FlagValue] = {
    "fs_type": "",
    "file_mode": "",
    "file_perm": "",
    "file_owner": "",
    "new_file_0644": "",
    "new_file_0666": "",
    "new_file_0660": "",
    "new_file_0777": "",
    "file_content": "",
    "file_content_in_loop": "",
    "retry_time": 180,
    "break_on_expected_content": True,
}


async def _mounttest(sh: Shell, argv: list[str], flags: Flags) -> int:
    return await _Mounttest(sh, flags).run()


async def _entrypoint_tester(sh: Shell, argv: list[str], flags: Flags) -> int:
    await sh.out("[" + " ".join(argv) + "]\n")  # Go's %v of os.Args
    return 0


_GO_SIGNAL_NAMES = {"INT": "interrupt", "TERM": "terminated"}


async def _pause(sh: Shell, argv: list[str], flags: Flags) -> int:
    await sh.out("Paused\nSignals registered\n")
    name = await wait_for_signal(sh, frozenset(_GO_SIGNAL_NAMES))
    message = f"exiting because of signal {go_quote(_GO_SIGNAL_NAMES[name])}\n"
    path = sh.vars.get("TERMINATION_MESSAGE_PATH") or "/dev/termination-log"
    try:
        sh.io.fs.write(sh.abspath(path), message.encode())
    except OSError:
        pass  # agnhost ignores it too
    await sh.out(message)
    return 1 if name == "INT" else 2


async def _read_or_panic(sh: Shell, path: str) -> str:
    try:
        return dec(sh.io.fs.read(path))
    except OSError as exc:
        raise ToolError(f"panic: open {path}: {go_error(exc)}", 2) from None


async def _etc_hosts(sh: Shell, argv: list[str], flags: Flags) -> int:
    await sh.out(await _read_or_panic(sh, "/etc/hosts") + "\n")
    return 0


def _resolv_field(text: str, key: str) -> list[str]:
    values: list[str] = []
    for line in text.splitlines():
        fields = line.split()
        if fields and fields[0] == key:
            values += fields[1:] if key == "search" else fields[1:2]
    return values


async def _dns_suffix(sh: Shell, argv: list[str], flags: Flags) -> int:
    text = await _read_or_panic(sh, "/etc/resolv.conf")
    await sh.out(",".join(_resolv_field(text, "search")) + "\n")
    return 0


async def _dns_server_list(sh: Shell, argv: list[str], flags: Flags) -> int:
    text = await _read_or_panic(sh, "/etc/resolv.conf")
    await sh.out(",".join(_resolv_field(text, "nameserver")) + "\n")
    return 0


Subcommand = Callable[[Shell, list[str], Flags], Awaitable[int]]

SUBCOMMANDS: dict[str, tuple[Subcommand, dict[str, str | int | bool]]] = {
    "mounttest": (_mounttest, MOUNTTEST_FLAGS),
    "entrypoint-tester": (_entrypoint_tester, {}),
    "pause": (_pause, {}),
    "etc-hosts": (_etc_hosts, {}),
    "dns-suffix": (_dns_suffix, {}),
    "dns-server-list": (_dns_server_list, {}),
    **agnhost_servers.SUBCOMMANDS,
}


async def _t_agnhost(sh: Shell, argv: list[str]) -> int:
    """agnhost SUBCOMMAND [--flag=value...] (also as /agnhost-2)."""
    if len(argv) < 2 or argv[1] in ("-h", "--help", "help"):
        await sh.out("Usage:\n  app [command]\n\nAvailable Commands:\n")
        await sh.out("".join(f"  {name}\n" for name in sorted(SUBCOMMANDS)))
        return 0
    name = argv[1]
    if name in ("--version", "version"):
        await sh.out("app version 2.56 (cri-shim fake)\n")
        return 0
    found = SUBCOMMANDS.get(name)
    if found is None:
        if name in NOT_SIMULATED:
            if sh.io.unknown_runs:
                await sh.sleep_forever()
                return 0
            raise ToolError(f"{name}: not simulated by the fake runtime's agnhost", 1)
        await sh.err(f'Error: unknown command "{name}" for "app"')
        await sh.err("Run 'app --help' for usage.")
        return 1
    run, spec = found
    try:
        flags = parse_flags(argv[2:], spec, operands=name == "entrypoint-tester")
    except ValueError as exc:
        await sh.err(f"Error: {exc}")
        await sh.err(f"Run 'app {name} --help' for usage.")
        return 1
    return await run(sh, argv, flags)


COMMANDS: dict[str, Builtin] = {"agnhost": _t_agnhost, "agnhost-2": _t_agnhost}
