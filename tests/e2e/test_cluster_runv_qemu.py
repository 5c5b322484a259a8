"""The cluster harness's runv node on the qemu driver (`up --runv-driver qemu`,
CRI_SHIM_CLUSTER_RUNV_DRIVER=qemu): its shim's config, what `up` refuses, what `down` stops.

No Kubernetes, QEMU or root needed: the files are written under a temporary directory and the
process `down` must stop is a `sleep` of the test's own. The cluster itself on qemu is
tests/e2e/test_cluster.py with that variable set (docs/testing.md).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from backends.runv import config as runv_config
from shim import cli
from shim.config import load
from tests.e2e.cluster import bringup, configs, layout, procs
from tests.e2e.cluster import workloads as w
from tests.e2e.cluster.__main__ import main
from tests.e2e.kubelet.config import runv_qemu_problem, shim_command

PAUSE = "127.0.0.1:5000/pause:3.10"


@pytest.fixture
def runv(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> layout.NodeSpec:
    monkeypatch.setattr(layout.NodeSpec, "dir", property(lambda n: tmp_path / n.name))
    for n in layout.NODES:
        n.dir.mkdir()  # as start_shim makes it
    return layout.node("runv")


def _runv_table(path: str) -> dict[str, object]:
    handler = load(path).handlers["runv"]
    runv_config.check("runv", handler.options)  # what the shim checks at start
    return dict(handler.options)


def test_the_runv_node_on_qemu_runs_the_qemu_driver_below_the_clusters_cgroup_parent(
    runv: layout.NodeSpec,
) -> None:
    argv = configs.shim_argv(runv, PAUSE, "qemu")
    args = cli._parser().parse_args(argv[len(shim_command()) :])
    assert args.command == "serve" and args.default_handler == "runv"
    table = _runv_table(args.config)
    assert table["driver"] == "qemu"
    # The same cgroup parent as the stub's: `down` and `check` find it by that name.
    assert table["qemu"] == {"cgroup_parent": f"cri-shim-runv-e2e-{layout.RUNV_TAG}"}
    assert table["pod_network"] == "cni"
    # A VM's agent socket is <run_dir>/<sandbox id>/agent.sock: it must fit in sun_path (108 bytes).
    agent = Path(str(table["run_dir"]), "f" * 64, "agent.sock")
    assert str(agent).startswith(f"{layout.RUN}/") and len(str(agent).encode()) < 108


def test_the_runv_node_stays_on_the_stub_by_default(runv: layout.NodeSpec) -> None:
    table = _runv_table(configs.shim_config(runv, PAUSE))
    assert "driver" not in table and "qemu" not in table
    with pytest.raises(ValueError, match="runv driver 'kvm'"):
        configs.shim_config(runv, PAUSE, "kvm")
    # The other nodes are the same on either driver.
    docker = layout.node("docker")
    assert (
        Path(configs.shim_config(docker, PAUSE, "qemu")).read_text()
        == Path(configs.shim_config(docker, PAUSE)).read_text()
    )


def test_the_qemu_driver_wants_its_guest_image(tmp_path: Path) -> None:
    problem = runv_qemu_problem(str(tmp_path))
    if problem and "qemu-system-x86_64" in problem:
        pytest.skip(problem)
    assert problem is not None and "vmlinuz" in problem and "scripts/runv-guest" in problem
    (tmp_path / "vmlinuz").write_bytes(b"")
    (tmp_path / "initrd.img").write_bytes(b"")
    assert runv_qemu_problem(str(tmp_path)) is None


def test_an_unknown_driver_is_refused_before_anything_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    b = layout.Binaries("/nonexistent", "/nonexistent/kubelet", "/usr/bin/etcd")
    monkeypatch.setattr(layout.Binaries, "problem", lambda self: None)
    monkeypatch.setattr(bringup.os, "geteuid", lambda: 0)
    assert "runv driver 'kvm'" in (bringup.environment_problem(b, runv_driver="kvm") or "")
    with pytest.raises(SystemExit):
        main(["up", "--runv-driver", "kvm"])


def test_down_stops_what_the_daemons_left_naming_the_clusters_paths(tmp_path: Path) -> None:
    """As a QEMU or its virtiofsd that outlived the runv node's shim: a process of its own whose
    command line names the cluster's directory, stopped by PID; another one is left alone."""
    ours = tmp_path / "run-of-the-cluster"
    sleep = [sys.executable, "-c", "import time; time.sleep(600)"]
    left = subprocess.Popen([*sleep, f"{ours}/vm/qemu"])
    other = subprocess.Popen([*sleep, f"{tmp_path}/elsewhere"])
    try:
        assert [line.split()[1] for line in procs.mentioning(ours)] == [f"{left.pid}:"]
        stopped = procs.stop_mentioning(ours, grace=10)
        assert len(stopped) == 1 and f"pid {left.pid}:" in stopped[0] and "(SIGTERM)" in stopped[0]
        assert left.wait(10) == -15
        assert other.poll() is None and procs.mentioning(ours) == []
    finally:
        for p in (left, other):
            p.kill()
            p.wait()


@pytest.mark.parametrize("driver", layout.RUNV_DRIVERS)
def test_runv_pods_pay_for_their_vm_through_the_runtime_class(driver: str) -> None:
    """The kubelet adds the RuntimeClass's overhead to the pod cgroup's limits; runv refuses a pod
    with memory limits whose cgroup cannot hold its VM (on qemu: the guest's and QEMU's own memory)."""
    classes = {rc["metadata"]["name"]: rc for rc in configs.runtime_classes(layout.NODES, driver)}
    assert set(classes) == {"runv", "fake"} and "overhead" not in classes["fake"]
    memory = classes["runv"]["overhead"]["podFixed"]["memory"]
    assert memory == {"stub": "32Mi", "qemu": "320Mi"}[driver]
    pod = w.pod("p", w.container("main", "busybox"), on=layout.node("runv"))
    assert pod["spec"]["runtimeClassName"] == "runv"
    assert (
        "runtimeClassName" not in w.pod("p", w.container("main", "busybox"), on=layout.node("fake"))["spec"]
    )
