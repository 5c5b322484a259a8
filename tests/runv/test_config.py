"""runv checks its config table when created: unknown keys and wrong types name handler, table, key."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from backends.contract.errors import InvalidArgumentError
from backends.runv import config, create


def _valid(tmp_path: Path) -> dict[str, Any]:
    return {
        "type": "runv",
        "state_dir": str(tmp_path / "state"),
        "pause_image": "registry.k8s.io/pause:3.10",
        "pull_no_progress_timeout": 120,
        "cgroup_driver": "cgroupfs",
        "root": str(tmp_path / "root"),
        "run_dir": str(tmp_path / "run"),
        "agent_timeout": 5,
        "overhead_vcpus": 0.5,
        "overhead_memory_mib": 32,
        "insecure_registries": ["127.0.0.1:5000"],
        "stub": {
            "cgroup_parent": "cri-shim-runv-cfgtest",
            "capacity_vcpus": 4,
            "boot_timeout": 20,
            "template": False,
        },
        "network": {"bridge": "rvcfg0", "subnet": "10.95.0.0/24", "mtu": 1400, "ipam_dir": str(tmp_path)},
    }


def test_a_valid_config_creates_the_backend(tmp_path: Path) -> None:
    backend = create("vm", _valid(tmp_path))
    assert backend.name == "vm" and backend.net.mtu == 1400 and backend.agent_timeout == 5.0
    assert backend.cni is None  # the builtin network, no [cni] table
    config.check("vm", {})  # everything is optional
    cni = create("vm", {**_valid(tmp_path), "pod_network": "cni", "cni": {"conf_dir": str(tmp_path)}})
    assert cni.cni is not None and cni.cni.adds and cni.cni.pin_dir == str(tmp_path / "root" / "netns")
    assert cni.cni.network.client.settings.cache_dir == str(tmp_path / "root" / "cni" / "vm")


@pytest.mark.parametrize(
    ("change", "error"),
    [
        ({"roots": "/x"}, r"\[handlers.vm\] unknown key 'roots' \(known: .*root.*\)"),
        ({"stub": {"capacity_cpus": 4}}, r"\[handlers.vm.stub\] unknown key 'capacity_cpus'"),
        ({"network": {"bridg": "x"}}, r"\[handlers.vm.network\] unknown key 'bridg'"),
        ({"stub": {"template": "yes"}}, r"\[handlers.vm.stub\] template: expected true or false, got 'yes'"),
        ({"agent_timeout": "10"}, r"\[handlers.vm\] agent_timeout: expected a non-negative number, got '10'"),
        ({"agent_timeout": True}, r"\[handlers.vm\] agent_timeout: expected a non-negative number, got True"),
        (
            {"overhead_memory_mib": -1},
            r"\[handlers.vm\] overhead_memory_mib: expected a non-negative integer",
        ),
        (
            {"insecure_registries": ["a", 1]},
            r"\[handlers.vm\] insecure_registries: expected a list of strings",
        ),
        (
            {"stub": {"capacity_memory": 1.5}},
            r"\[handlers.vm.stub\] capacity_memory: expected a non-negative integer",
        ),
        ({"stub": {"runc": ["runc"]}}, r"\[handlers.vm.stub\] runc: expected a string"),
        (
            {"network": {"mtu": "1500"}},
            r"\[handlers.vm.network\] mtu: expected a non-negative integer, got '1500'",
        ),
        ({"network": "crishim-rv0"}, r"\[handlers.vm\] network: expected a table"),
        ({"pod_network": "calico"}, r"\[handlers.vm\] pod_network: 'calico' is not 'builtin' or 'cni'"),
        ({"cni": {"plugin_timeout": 0}}, r"\[cni\] plugin_timeout: must be more than 0"),
    ],
    ids=[
        "unknown-top",
        "unknown-stub",
        "unknown-network",
        "string-for-bool",
        "string-for-number",
        "bool-for-number",
        "negative",
        "list-item",
        "float-for-int",
        "list-for-string",
        "string-for-int",
        "not-a-table",
        "pod-network",
        "cni-table",
    ],
)
def test_bad_key_or_type_is_an_error_naming_handler_table_key(
    tmp_path: Path, change: dict[str, Any], error: str
) -> None:
    cfg = _valid(tmp_path)
    for key, value in change.items():
        if isinstance(value, dict) and isinstance(cfg.get(key), dict):
            cfg[key] = {**cfg[key], **value}
        else:
            cfg[key] = value
    with pytest.raises(InvalidArgumentError, match=error):
        create("vm", cfg)
    assert not (tmp_path / "root").exists()  # raised before anything was made


@pytest.mark.parametrize("driver", ["cgroupfs", "systemd"])
def test_runtime_config_reports_the_configured_cgroup_driver(tmp_path: Path, driver: str) -> None:
    """The kubelet's pod cgroups follow the driver the node uses, which RuntimeConfig tells it;
    the VMs' cgroups go below them either way (test_pod_cgroup.py)."""
    from cri_api import api_pb2 as pb

    backend = create("vm", {**_valid(tmp_path), "cgroup_driver": driver})
    want = pb.SYSTEMD if driver == "systemd" else pb.CGROUPFS
    assert backend.lifecycle.runtime_config().linux.cgroup_driver == want
