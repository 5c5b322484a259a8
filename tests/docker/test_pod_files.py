"""backends/docker/pod_files.py: a CNI pod's own hosts and resolv.conf (no engine needed)."""

from __future__ import annotations

import os
from pathlib import Path

from backends.docker import pod_files
from backends.docker.pod_files import PodFiles
from cri_api import api_pb2 as pb


def test_the_hosts_resolv_conf_less_its_loopback_servers() -> None:
    host = (
        "# written by hand\nsearch example.org\nnameserver 127.0.0.53\nnameserver 10.0.0.2\nnameserver ::1\n"
    )
    assert pod_files.resolv_from_host(host) == "# written by hand\nsearch example.org\nnameserver 10.0.0.2\n"


def test_only_loopback_servers_give_the_engines_defaults() -> None:
    out = pod_files.resolv_from_host("nameserver 127.0.0.53\noptions edns0\n")
    assert out == "options edns0\nnameserver 8.8.8.8\nnameserver 8.8.4.4\n"
    assert pod_files.resolv_from_host("") == "nameserver 8.8.8.8\nnameserver 8.8.4.4\n"


def test_written_from_the_dns_config_or_the_host_then_removed_and_swept(tmp_path: Path) -> None:
    host = tmp_path / "host-resolv.conf"
    host.write_text("nameserver 192.0.2.1\n")
    files = PodFiles(str(tmp_path / "pod-files"), str(host))
    one = files.write("one", pb.DNSConfig(servers=["10.96.0.10"], searches=["svc"], options=["ndots:5"]))
    assert Path(one, "resolv.conf").read_text() == "search svc\nnameserver 10.96.0.10\noptions ndots:5\n"
    assert Path(one, "hosts").read_text().startswith("127.0.0.1\tlocalhost\n")
    two = files.write("two", None)
    assert Path(two, "resolv.conf").read_text() == "nameserver 192.0.2.1\n"
    host.unlink()  # a host with no resolv.conf at all
    assert (
        Path(files.write("three", None), "resolv.conf").read_text()
        == "nameserver 8.8.8.8\nnameserver 8.8.4.4\n"
    )
    files.remove("one")
    assert sorted(os.listdir(files.root)) == ["three", "two"]
    files.sweep(["two"])
    assert os.listdir(files.root) == ["two"]
    assert not os.path.exists(f"{two}/resolv.conf.tmp")


def test_binds_leave_out_what_the_container_mounts_itself() -> None:
    both = pod_files.binds("/s/p", pb.ContainerConfig())
    assert both == ["/s/p/hosts:/etc/hosts", "/s/p/resolv.conf:/etc/resolv.conf"]
    own = pb.ContainerConfig(mounts=[pb.Mount(container_path="/etc/hosts/", host_path="/k/etc-hosts")])
    assert pod_files.binds("/s/p", own) == ["/s/p/resolv.conf:/etc/resolv.conf"]
