"""The OCI config the agent builds: capabilities, PID namespace sharing, masked paths."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from backends.runv.agent import oci
from backends.runv.agent.messages import ContainerSpec


def _config(tmp_path: Path, **spec: Any) -> dict[str, Any]:
    return oci.build_config(ContainerSpec.from_dict({"args": ["true"], **spec}), str(tmp_path), {}, "/x")


def test_capabilities_limited_to_the_agents(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(oci, "available_caps", lambda: set(oci.ALL_CAPS) - {"CAP_SYS_RESOURCE", "CAP_KILL"})
    caps = _config(tmp_path, privileged=True)["process"]["capabilities"]["bounding"]
    assert "CAP_SYS_RESOURCE" not in caps and "CAP_SYS_ADMIN" in caps
    assert "CAP_KILL" not in _config(tmp_path)["process"]["capabilities"]["bounding"]


def test_available_caps_reads_the_bounding_set() -> None:
    caps = oci.available_caps()
    assert "CAP_CHOWN" in caps and caps <= set(oci.ALL_CAPS)


def test_capabilities(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(oci, "available_caps", lambda: set(oci.ALL_CAPS))
    default = _config(tmp_path)["process"]["capabilities"]["bounding"]
    assert default == oci.DEFAULT_CAPS
    assert _config(tmp_path, drop_caps=["CAP_ALL"])["process"]["capabilities"]["bounding"] == []
    some = _config(tmp_path, drop_caps=["CAP_ALL"], add_caps=["CAP_NET_ADMIN"])["process"]["capabilities"]
    assert some["effective"] == ["CAP_NET_ADMIN"]
    assert _config(tmp_path, add_caps=["CAP_ALL"])["process"]["capabilities"]["bounding"] == oci.ALL_CAPS
    priv = _config(tmp_path, privileged=True, drop_caps=["CAP_ALL"])
    assert priv["process"]["capabilities"]["bounding"] == oci.ALL_CAPS
    assert priv["linux"]["resources"]["devices"] == [{"allow": True, "access": "rwm"}]
    assert priv["linux"]["maskedPaths"] == [] and priv["linux"]["readonlyPaths"] == []
    sys_mount = next(m for m in priv["mounts"] if m["destination"] == "/sys")
    assert "ro" not in sys_mount["options"]


def test_pid_namespace_and_paths(tmp_path: Path) -> None:
    def types(cfg: dict[str, Any]) -> list[str]:
        return [n["type"] for n in cfg["linux"]["namespaces"]]

    assert types(_config(tmp_path)) == ["pid", "mount"]
    assert types(_config(tmp_path, pid_mode="pod")) == ["mount"]
    assert types(_config(tmp_path, pid_mode="node")) == ["mount"]
    cfg = _config(tmp_path, masked_paths=["/proc/a"], readonly_paths=["/proc/b"])
    assert (cfg["linux"]["maskedPaths"], cfg["linux"]["readonlyPaths"]) == (["/proc/a"], ["/proc/b"])
    assert _config(tmp_path)["linux"]["maskedPaths"] == oci.DEFAULT_MASKED


def test_seccomp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(oci, "available_caps", lambda: set(oci.ALL_CAPS))
    assert "seccomp" not in _config(tmp_path)["linux"]
    default = _config(tmp_path, seccomp={"default": True})["linux"]["seccomp"]
    assert default["defaultAction"] == "SCMP_ACT_ALLOW"
    assert "mount" in default["syscalls"][0]["names"] and "kexec_load" in default["syscalls"][0]["names"]
    admin = _config(tmp_path, seccomp={"default": True}, add_caps=["CAP_SYS_ADMIN"])["linux"]["seccomp"]
    assert "mount" not in admin["syscalls"][0]["names"]
    profile = {
        "defaultAction": "SCMP_ACT_ALLOW",
        "archMap": [{"architecture": "SCMP_ARCH_X86_64", "subArchitectures": ["SCMP_ARCH_X86"]}],
        "syscalls": [
            {"names": ["sethostname"], "action": "SCMP_ACT_ERRNO"},
            {"names": ["chmod"], "action": "SCMP_ACT_ERRNO", "excludes": {"caps": ["CAP_CHOWN"]}},
            {"name": "fchmod", "action": "SCMP_ACT_ERRNO", "includes": {"caps": ["CAP_SYS_ADMIN"]}},
        ],
    }
    local = _config(tmp_path, seccomp={"profile": profile})["linux"]["seccomp"]
    assert local["architectures"] == ["SCMP_ARCH_X86_64", "SCMP_ARCH_X86"]
    assert local["syscalls"] == [{"names": ["sethostname"], "action": "SCMP_ACT_ERRNO"}]
    assert "seccomp" not in _config(tmp_path, seccomp={"profile": profile}, privileged=True)["linux"]


def test_supplementary_groups_merge_or_strict(tmp_path: Path) -> None:
    from backends.runv.agent.messages import User

    (tmp_path / "etc").mkdir()
    (tmp_path / "etc/passwd").write_text(
        "root:x:0:0::/root:/bin/sh\nalice:x:1000:1000::/home/alice:/bin/sh\n"
    )
    (tmp_path / "etc/group").write_text(
        "root:x:0:\nalice:x:1000:\nextra:x:50000:alice,bob\nother:x:60000:bob\nself:x:1234:alice\n"
    )
    merge = ContainerSpec(args=["id"], user=User(uid=1000), supplemental_groups=[1234])
    assert oci.identity(merge, str(tmp_path)) == (1000, 1000, [1000, 1234, 50000])
    strict = ContainerSpec(
        args=["id"], user=User(uid=1000), supplemental_groups=[1234], groups_policy="strict"
    )
    assert oci.identity(strict, str(tmp_path)) == (1000, 1000, [1000, 1234])
    cfg = oci.build_config(strict, str(tmp_path), {}, "/x")
    assert cfg["process"]["user"] == {"uid": 1000, "gid": 1000, "additionalGids": [1000, 1234]}
    # No /etc/group, or a uid the image does not name: only what was asked.
    assert oci.identity(ContainerSpec(args=["id"], user=User(uid=7)), str(tmp_path)) == (7, 0, [0])
