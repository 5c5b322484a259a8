"""Pure parts of the docker backend: CRI -> Engine API configs, references, times. No engine needed."""

from __future__ import annotations

import base64
import errno
import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from backends.docker import convert
from backends.docker import labels as lbl
from backends.docker.backend import LogResume, exit_info, parse_time
from backends.docker.images import _pull_error, registry_auth, split_reference
from backends.linux import cgroups
from backends.linux.cgroups import CgroupReader, HugetlbError
from cri_api import api_pb2 as pb
from shim.cri.container_io import last_log_marks
from shim.cri.errors import FailedPreconditionError, InternalError, InvalidArgumentError, NotFoundError

SB_ID = "a" * 64
CT_ID = "b" * 64
STRICT = convert.HostFacts(negative_oom_score_adj=False)


def pod(**linux: object) -> pb.PodSandboxConfig:
    return pb.PodSandboxConfig(
        metadata=pb.PodSandboxMetadata(name="web", uid="u1", namespace="ns", attempt=1),
        hostname="web-0",
        port_mappings=[
            pb.PortMapping(protocol=pb.UDP, container_port=53, host_port=5353, host_ip="127.0.0.1"),
            pb.PortMapping(protocol=pb.TCP, container_port=80),
        ],
        linux=pb.LinuxPodSandboxConfig(**linux),
    )


def sandbox_cfg(config: pb.PodSandboxConfig) -> dict[str, Any]:
    return convert.sandbox_config(
        SB_ID,
        "docker",
        7,
        config,
        image="pause",
        network="bridge",
        runtime="runc",
        cgroup_parent="/p",
        instance="i",
    )


def container_cfg(
    config: pb.ContainerConfig, sandbox: pb.PodSandboxConfig | None = None, **kw: object
) -> dict[str, Any]:
    args: dict[str, Any] = {
        "image_id": "sha256:1",
        "image_name": "busybox",
        "log_path": "/l",
        "pause_engine_id": "PAUSE",
        "target_engine_id": "",
        "runtime": None,
        "cgroup_parent": "",
        "facts": STRICT,
        "instance": "i",
    }
    args.update(kw)
    return convert.container_config(CT_ID, SB_ID, 9, config, sandbox or pod(), **args)


def test_sandbox_ports_hostname_labels() -> None:
    cfg = sandbox_cfg(pod(sysctls={"net.core.somaxconn": "1024"}))
    host = cfg["HostConfig"]
    assert cfg["Hostname"] == "web-0"
    assert cfg["ExposedPorts"] == {"53/udp": {}, "80/tcp": {}}
    assert host["PortBindings"] == {"53/udp": [{"HostIp": "127.0.0.1", "HostPort": "5353"}]}
    assert host["NetworkMode"] == "bridge" and host["IpcMode"] == "shareable"
    assert host["CgroupParent"] == "/p" and host["Runtime"] == "runc"
    assert host["Sysctls"] == {"net.core.somaxconn": "1024"}
    labels = cfg["Labels"]
    assert labels[lbl.ID] == SB_ID and labels[lbl.KIND] == lbl.SANDBOX and labels[lbl.INSTANCE] == "i"
    assert lbl.decode_sandbox_config(labels[lbl.CONFIG]).hostname == "web-0"


def test_sandbox_host_namespaces() -> None:
    ns = pb.NamespaceOption(network=pb.NODE, pid=pb.NODE, ipc=pb.NODE)
    cfg = sandbox_cfg(
        pod(
            cgroup_parent="/kubepods/pod1",
            security_context=pb.LinuxSandboxSecurityContext(namespace_options=ns),
        )
    )
    host = cfg["HostConfig"]
    assert "Hostname" not in cfg and cfg["ExposedPorts"] == {}
    assert (host["NetworkMode"], host["PidMode"], host["IpcMode"]) == ("host", "host", "host")
    assert host["CgroupParent"] == "/kubepods/pod1"


@pytest.mark.parametrize(
    ("mode", "sandbox_pid", "target", "want"),
    [
        (pb.POD, pb.POD, "", "container:PAUSE"),
        (pb.POD, pb.NODE, "", "host"),
        (pb.CONTAINER, pb.POD, "", None),
        (pb.NODE, pb.POD, "", "host"),
        (pb.TARGET, pb.POD, "T1", "container:T1"),
    ],
    ids=["pod", "pod-of-host-pid-sandbox", "container", "node", "target"],
)
def test_container_pid_namespace(mode: int, sandbox_pid: int, target: str, want: str | None) -> None:
    sb = pod(
        security_context=pb.LinuxSandboxSecurityContext(namespace_options=pb.NamespaceOption(pid=sandbox_pid))
    )
    ct = pb.ContainerConfig(
        linux=pb.LinuxContainerConfig(
            security_context=pb.LinuxContainerSecurityContext(
                namespace_options=pb.NamespaceOption(pid=mode, target_id="t")
            )
        )
    )
    host = container_cfg(ct, sb, target_engine_id=target)["HostConfig"]
    assert host.get("PidMode") == want
    assert host["NetworkMode"] == "container:PAUSE" and host["IpcMode"] == "container:PAUSE"


def test_target_pid_namespace_missing() -> None:
    ct = pb.ContainerConfig(
        linux=pb.LinuxContainerConfig(
            security_context=pb.LinuxContainerSecurityContext(
                namespace_options=pb.NamespaceOption(pid=pb.TARGET, target_id="gone")
            )
        )
    )
    with pytest.raises(InvalidArgumentError):
        container_cfg(ct)


@pytest.mark.parametrize(
    ("command", "args", "entrypoint", "cmd"),
    [
        ([], [], None, None),
        (["sh"], [], ["sh"], []),
        (["sh"], ["-c", "x"], ["sh"], ["-c", "x"]),
        ([], ["x"], None, ["x"]),
    ],
    ids=["image-defaults", "command-only", "command-args", "args-only"],
)
def test_command_and_args(command: list[str], args: list[str], entrypoint: object, cmd: object) -> None:
    cfg = container_cfg(pb.ContainerConfig(command=command, args=args))
    assert cfg.get("Entrypoint") == entrypoint and cfg.get("Cmd") == cmd


def test_container_fields(tmp_path: Path) -> None:
    profile = tmp_path / "seccomp.json"
    profile.write_text('{"defaultAction": "SCMP_ACT_ALLOW"}')
    sc = pb.LinuxContainerSecurityContext(
        run_as_username="www-data",
        run_as_group=pb.Int64Value(value=1004),
        supplemental_groups=[5, 6],
        capabilities=pb.Capability(add_capabilities=["NET_ADMIN"], drop_capabilities=["ALL"]),
        readonly_rootfs=True,
        no_new_privs=True,
        masked_paths=["/proc/kcore"],
        readonly_paths=["/proc/sys"],
        seccomp=pb.SecurityProfile(profile_type=pb.SecurityProfile.Localhost, localhost_ref=str(profile)),
        apparmor=pb.SecurityProfile(profile_type=pb.SecurityProfile.Unconfined),
    )
    res = pb.LinuxContainerResources(
        cpu_period=100000, cpu_quota=50000, cpu_shares=512, memory_limit_in_bytes=1 << 26, oom_score_adj=-998
    )
    ct = pb.ContainerConfig(
        envs=[pb.KeyValue(key="A", value=b"1")],
        working_dir="/w",
        tty=True,
        stdin=True,
        stdin_once=True,
        mounts=[
            pb.Mount(container_path="/data", host_path=str(tmp_path), readonly=True, selinux_relabel=True),
            pb.Mount(
                container_path="/shared", host_path=str(tmp_path), propagation=pb.PROPAGATION_BIDIRECTIONAL
            ),
        ],
        devices=[pb.Device(container_path="/dev/x", host_path="/dev/null", permissions="r")],
        linux=pb.LinuxContainerConfig(security_context=sc, resources=res),
        stop_signal=pb.SIGNAL_SIGUSR1,
    )
    cfg = container_cfg(ct)
    host = cfg["HostConfig"]
    assert cfg["User"] == "www-data:1004"
    assert cfg["Env"] == ["A=1"] and cfg["WorkingDir"] == "/w"
    assert (cfg["Tty"], cfg["OpenStdin"], cfg["StdinOnce"]) == (True, True, True)
    assert cfg["StopSignal"] == "SIGUSR1"
    assert host["Binds"] == [f"{tmp_path}:/data:ro,rprivate,Z", f"{tmp_path}:/shared:rw,rshared"]
    assert host["Devices"] == [
        {"PathOnHost": "/dev/null", "PathInContainer": "/dev/x", "CgroupPermissions": "r"}
    ]
    assert host["GroupAdd"] == ["5", "6"] and host["CapAdd"] == ["NET_ADMIN"] and host["CapDrop"] == ["ALL"]
    assert (
        host["ReadonlyRootfs"]
        and host["MaskedPaths"] == ["/proc/kcore"]
        and host["ReadonlyPaths"] == ["/proc/sys"]
    )
    assert host["SecurityOpt"] == [
        'seccomp={"defaultAction": "SCMP_ACT_ALLOW"}',
        "apparmor=unconfined",
        "no-new-privileges",
    ]
    assert (host["CpuPeriod"], host["CpuQuota"], host["CpuShares"]) == (100000, 50000, 512)
    assert host["Memory"] == host["MemorySwap"] == 1 << 26
    assert host["OomScoreAdj"] == 0  # clamped: the host refuses negative values


def test_oom_score_adj_allowed_when_capable() -> None:
    assert convert.oom_score_adj(-998, convert.HostFacts(negative_oom_score_adj=True)) == -998
    assert convert.oom_score_adj(1500, STRICT) == 1000


def test_unset_seccomp_is_unconfined_and_missing_profile_fails() -> None:
    assert "seccomp=unconfined" in container_cfg(pb.ContainerConfig())["HostConfig"]["SecurityOpt"]
    bad = pb.ContainerConfig(
        linux=pb.LinuxContainerConfig(
            security_context=pb.LinuxContainerSecurityContext(
                seccomp_profile_path="localhost//nonexistent.json"
            )
        )
    )
    with pytest.raises(InvalidArgumentError):
        container_cfg(bad)


def test_missing_mount_source_fails() -> None:
    ct = pb.ContainerConfig(mounts=[pb.Mount(container_path="/x", host_path="/nonexistent/crishim")])
    with pytest.raises(InvalidArgumentError):
        container_cfg(ct)


def test_resolv_conf() -> None:
    dns = pb.DNSConfig(servers=["1.1.1.1", "8.8.8.8"], searches=["a.svc", "svc"], options=["ndots:5"])
    assert (
        convert.resolv_conf(dns)
        == "search a.svc svc\nnameserver 1.1.1.1\nnameserver 8.8.8.8\noptions ndots:5\n"
    )


@pytest.mark.parametrize(
    ("ref", "want"),
    [
        ("busybox", ("docker.io/library/busybox", "latest")),
        ("127.0.0.1:5000/busybox", ("127.0.0.1:5000/busybox", "latest")),
        ("127.0.0.1:5000/busybox:1.36", ("127.0.0.1:5000/busybox", "1.36")),
        ("r.io/a/b@sha256:" + "0" * 64, ("r.io/a/b@sha256:" + "0" * 64, "")),
        ("r.io/a/b:v1@sha256:" + "0" * 64, ("r.io/a/b@sha256:" + "0" * 64, "")),
    ],
    ids=["bare", "registry-port", "tag", "digest", "tag-and-digest"],
)
def test_split_reference(ref: str, want: tuple[str, str]) -> None:
    assert split_reference(ref) == want


def test_registry_auth_header() -> None:
    assert registry_auth(None, "busybox") is None
    assert registry_auth(pb.AuthConfig(), "busybox") is None
    header = registry_auth(pb.AuthConfig(auth=base64.b64encode(b"u:p:w").decode()), "reg.io:5000/x")
    assert header is not None
    body = json.loads(base64.urlsafe_b64decode(header))
    assert body == {"serveraddress": "reg.io:5000", "username": "u", "password": "p:w"}


def test_parse_time_and_exit_info() -> None:
    assert parse_time("0001-01-01T00:00:00Z") == 0
    assert parse_time("1970-01-01T00:00:01.5Z") == 1_500_000_000
    assert parse_time("1970-01-01T00:00:01.000000007+00:00") == 1_000_000_007
    info = exit_info(
        {
            "ExitCode": 137,
            "OOMKilled": True,
            "StartedAt": "1970-01-01T00:00:02Z",
            "FinishedAt": "1970-01-01T00:00:01Z",
        }
    )
    assert (info.exit_code, info.reason, info.finished_at) == (137, "OOMKilled", 2_000_000_000)
    assert exit_info({"ExitCode": 0, "FinishedAt": "1970-01-01T00:00:01Z"}).reason == "Completed"
    assert exit_info({"ExitCode": 2, "FinishedAt": "1970-01-01T00:00:01Z"}).reason == "Error"


def test_privileged_and_all_caps_on_a_host_missing_capabilities() -> None:
    facts = convert.HostFacts(negative_oom_score_adj=False, bounding_caps=("CHOWN", "NET_ADMIN"))
    sc = pb.LinuxContainerSecurityContext(
        privileged=True,
        masked_paths=["/proc/kcore"],
        seccomp=pb.SecurityProfile(profile_type=pb.SecurityProfile.RuntimeDefault),
    )
    host = container_cfg(pb.ContainerConfig(linux=pb.LinuxContainerConfig(security_context=sc)), facts=facts)[
        "HostConfig"
    ]
    assert host["Privileged"] is False and host["CapAdd"] == ["CHOWN", "NET_ADMIN"] and host["CapDrop"] == []
    assert {"seccomp=unconfined", "apparmor=unconfined"} <= set(host["SecurityOpt"])
    assert host["MaskedPaths"] == host["ReadonlyPaths"] == [] and host["DeviceCgroupRules"] == ["a *:* rwm"]
    assert any(d["PathOnHost"] == "/dev/null" for d in host["Devices"])

    caps = pb.Capability(add_capabilities=["ALL"])
    sc = pb.LinuxContainerSecurityContext(capabilities=caps)
    host = container_cfg(pb.ContainerConfig(linux=pb.LinuxContainerConfig(security_context=sc)), facts=facts)[
        "HostConfig"
    ]
    assert host["CapAdd"] == ["CHOWN", "NET_ADMIN"] and host["Privileged"] is False
    # A host with every capability keeps the engine's own privileged mode.
    sc = pb.LinuxContainerSecurityContext(privileged=True)
    host = container_cfg(pb.ContainerConfig(linux=pb.LinuxContainerConfig(security_context=sc)))["HostConfig"]
    assert host["Privileged"] is True


@pytest.mark.parametrize(
    ("message", "kind"),
    [
        ("manifest for 127.0.0.1:5000/x:1 not found: manifest unknown", NotFoundError),
        (
            'Get "https://registry-1.docker.io/v2/": dial tcp: lookup registry-1.docker.io: no such host',
            NotFoundError,
        ),
        (
            'Get "http://127.0.0.1:1/v2/": dial tcp 127.0.0.1:1: connect: connection refused',
            FailedPreconditionError,
        ),
        ("invalid reference format", InvalidArgumentError),
        ("something else broke", InternalError),
    ],
    ids=["missing", "unresolvable", "refused", "bad-reference", "other"],
)
def test_pull_error_conditions(message: str, kind: type[Exception]) -> None:
    assert type(_pull_error("ref", message)) is kind


def test_log_resume_skips_what_was_written_per_stream() -> None:
    # The engine's log as written: stderr's copier ran late, so its record at 100
    # follows stdout's at 105; the two pieces of a long line share time 110.
    log = [
        ("stdout", 95),
        ("stdout", 105),
        ("stderr", 100),
        ("stdout", 110),
        ("stdout", 110),
        ("stderr", 120),
    ]
    r = LogResume()
    assert r.since(tty=False) is None
    r.reread()
    assert [r.fresh(s, at) for s, at in log[:4]] == [True] * 4  # cut after the first piece
    assert r.newest == 110
    # The re-read starts 2 s back and sees everything again, then what is new.
    r.reread()
    assert r.since(tty=False) == 0
    assert [r.fresh(s, at) for s, at in log] == [False, False, False, False, True, True]
    r.reread()
    assert [r.fresh(s, at) for s, at in log] == [False] * 6
    assert r.fresh("stdout", 0)  # no time: always written
    assert r.since(tty=True) == 121


def test_log_resume_marks_read_off_a_cri_log(tmp_path: Path) -> None:
    path = tmp_path / "c.log"
    t = "2026-11-30T10:00:00.00000000{}Z"
    path.write_text(
        f"{t.format(1)} stdout F a\n{t.format(2)} stderr F b\n{t.format(3)} stdout P c\n{t.format(3)} stdout F d\n"
    )
    base = parse_time(t.format(0))
    marks = last_log_marks(str(path))
    assert marks == {"stdout": (base + 3, 2), "stderr": (base + 2, 1)}
    r = LogResume(marks)
    r.reread()
    # Re-reading: the two records at +3 and the one at +2 were written; +4 is new.
    got = [
        r.fresh(s, base + d)
        for s, d in [("stdout", 1), ("stderr", 2), ("stdout", 3), ("stdout", 3), ("stdout", 4)]
    ]
    assert got == [False, False, False, False, True]
    assert last_log_marks(str(tmp_path / "absent.log")) is None
    only_out = tmp_path / "o.log"
    only_out.write_text(f"{t.format(1)} stdout F a\n{t.format(5)} stdout F b\n")
    # stderr wrote nothing in what was read: anything of it from the first record on is new.
    assert last_log_marks(str(only_out)) == {"stdout": (base + 5, 1), "stderr": (base + 1, 0)}


def test_hugepage_limits_of_a_container_that_already_exited_are_no_error() -> None:
    """An init container can exit before its limits are written: it started, nothing is left to limit."""
    proc = subprocess.Popen(["true"])
    proc.wait()  # reaped: /proc/PID is gone
    assert CgroupReader().set_hugetlb(proc.pid, "engine-id", [("2MB", 0)]) == []
    # A live process whose cgroups do not name the container (the PID was reused): nothing written.
    assert CgroupReader().set_hugetlb(os.getpid(), "not-this-container", [("2MB", 0)]) == []


def test_hugepage_limits_when_the_cgroup_goes_while_they_are_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A container that exits right after its start: its cgroup can be removed between reading
    /proc/PID/cgroup and the write (ENODEV from a file removed while open, or ENOENT). It did
    start and nothing is left to limit: no error (the kubelet would report a start failure)."""
    base = tmp_path / "hugetlb" / "ctr"
    reader = CgroupReader()
    monkeypatch.setattr(reader, "_paths", lambda pid, expect: ({"hugetlb": str(base)}, None))
    written: list[str] = []

    def fake_open(path: str, mode: str = "r") -> Any:
        if errors:
            number = errors.pop(0)
            if number == errno.ENODEV and base.is_dir():
                base.rmdir()  # removed while the file was open
            raise OSError(number, os.strerror(number), path)
        written.append(os.path.basename(path))
        return open(os.devnull, "w")

    monkeypatch.setattr(cgroups, "open", fake_open, raising=False)
    limits = [("2MB", 0), ("1GB", 0)]
    for first in (errno.ENODEV, errno.ENOENT):
        base.mkdir(parents=True, exist_ok=True)
        errors = [first]
        if first == errno.ENOENT:
            base.rmdir()  # already gone when opened
        assert reader.set_hugetlb(1, "ctr", limits) == []
        assert written == []
    # The cgroup still there: a missing page size is passed over with its reason, another error is one.
    base.mkdir(parents=True)
    errors = [errno.ENOENT]
    skipped = reader.set_hugetlb(1, "ctr", limits)
    assert len(skipped) == 1 and "no 2MB huge pages" in skipped[0]
    assert written == ["hugetlb.1GB.limit_in_bytes"]
    errors = [errno.EINVAL]
    with pytest.raises(HugetlbError, match="cannot limit 2MB huge pages to 0"):
        reader.set_hugetlb(1, "ctr", limits)
