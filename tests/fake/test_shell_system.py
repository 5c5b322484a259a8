"""The system tools of the fake's shell as the node e2e specs use them: hostname and its
resolution through /etc/hosts."""

from __future__ import annotations

import pytest

from backends.fake.shell import MemoryFs
from tests.fake.harness import Harness

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
