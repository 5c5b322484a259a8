"""The system tools of the fake's shell as the node e2e specs use them: hostname and its
resolution through /etc/hosts, the shell's error messages, nmeter's timestamps."""

from __future__ import annotations

import datetime

import pytest

from backends.fake.shell import MemoryFs
from tests.fake.harness import NOW, Harness

# The kubelet's /etc/hosts for pod "web" with subdomain "t" in namespace "ns".
_HOSTS = "127.0.0.1\tlocalhost\n::1\tlocalhost\n# Entries added by HostAliases.\n10.0.0.7\tweb.t.ns.svc.cluster.local\tweb\n"


@pytest.mark.parametrize(
    ("hosts", "script", "stdout"),
    [
        (_HOSTS, "echo $(hostname)';'$(hostname -f)';'", "web;web.t.ns.svc.cluster.local;\n"),
        (_HOSTS, "hostname -s; hostname -d; hostname -i", "web\nt.ns.svc.cluster.local\n10.0.0.7\n"),
        ("10.0.0.7\tweb\n", "echo $(hostname)';'$(hostname -f)';'", "web;web;\n"),  # no subdomain
        (None, "hostname -f; hostname -d", "web\n\n"),  # not in /etc/hosts: the name itself
    ],
    ids=["fqdn", "short-domain-ip", "no-subdomain", "no-hosts"],
)
async def test_hostname_resolves_through_etc_hosts(hosts: str | None, script: str, stdout: str) -> None:
    h = Harness(fs=MemoryFs({"/etc/hosts": hosts} if hosts is not None else {}))
    h.io.hostname = "web"
    result = await h.run(["sh", "-c", script])
    assert (result.stdout.decode(), result.stderr, result.code) == (stdout, b"", 0)


@pytest.mark.parametrize(
    ("argv", "stderr"),
    [
        (["/bin/sh", "-c", "echo test > /file"], b"/bin/sh: can't create /file: Read-only file system\n"),
        (["sh", "-c", "echo test > /file"], b"sh: can't create /file: Read-only file system\n"),
        (["sh", "-c", "nope", "named"], b"named: nope: not found\n"),  # $0 given after the script
    ],
    ids=["bin-sh", "sh", "dollar-zero"],
)
async def test_the_shells_errors_name_it_as_invoked(argv: list[str], stderr: bytes) -> None:
    """The node e2e spec 'a read only busybox container should not write to root filesystem' reads
    exactly `/bin/sh: can't create /file: Read-only file system` from the log."""
    result = await Harness(fs=MemoryFs({}, read_only=["/"])).run(argv)
    assert (result.stderr, result.code) == (stderr, 127 if "nope" in argv else 1)


async def test_nmeter_times_the_node_e2e_lifecycle_logs() -> None:
    """The node e2e Containers Lifecycle specs stamp every line with
    `date -u +%FT$(nmeter -d0 '%3t' | head -n1)Z` and parse it as RFC 3339; without nmeter a
    container's command waited forever on it."""
    h = Harness()
    h.io.clock = lambda: NOW + 0.1234
    h.io.unknown_runs = True  # as a container's command: a missing program would block it
    script = (
        "echo `date -u +%FT$(nmeter -d0 '%3t' | head -n1)Z` 'init-1 Started'; nmeter -d 10 'x%t%%' | head -n2"
    )
    result = await h.run(["sh", "-c", script])
    stamp = datetime.datetime.fromtimestamp(NOW, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S")
    lines = [f"{stamp}.123Z init-1 Started", "x12:00:00%", "x12:00:00%"]
    assert (result.stdout.decode().splitlines(), result.stderr, result.code) == (lines, b"", 0)
    assert h.slept and set(h.slept) == {0.01}  # -d 10: 10 ms between its lines
