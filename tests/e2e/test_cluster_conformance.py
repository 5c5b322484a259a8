"""The conformance runner's command lines (tests/e2e/cluster/conformance.py); no cluster needed.

The run itself is opt-in (``python -m tests.e2e.cluster conformance`` on a cluster that ``up``
left running) and takes an hour or more; its figures are in docs/cluster.md ("Results").
"""

from __future__ import annotations

import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest

from tests.e2e.cluster import configs, conformance, layout, pki
from tests.e2e.cluster.layout import Binaries


def _flags(argv: list[str]) -> tuple[list[str], list[str]]:
    """ginkgo's flags and the suite's (after ``--``)."""
    split = argv.index("--")
    return argv[:split], argv[split + 1 :]


@pytest.mark.parametrize(
    ("phase", "procs", "labels"),
    [("parallel", "--procs=4", "Conformance && !Serial"), ("serial", "--procs=1", "Conformance && Serial")],
    ids=["parallel", "serial"],
)
def test_phase_selects_by_label(phase: str, procs: str, labels: str, tmp_path: Path) -> None:
    b = Binaries("/k8s/bin", "/k8s/bin/kubelet", "/usr/bin/etcd")
    argv = conformance.suite_argv(b, conformance.Options(out=tmp_path, procs=4), phase)
    ginkgo, suite = _flags(argv)
    assert ginkgo[0] == "/k8s/bin/ginkgo" and ginkgo[-1] == "/k8s/bin/e2e.test"
    assert procs in ginkgo and f"--label-filter={labels}" in ginkgo
    assert f"--json-report={tmp_path / phase / 'report.json'}" in ginkgo
    assert not any(f.startswith(("--focus", "--skip")) for f in ginkgo)  # none asked for
    assert "--provider=skeleton" in suite and "--kubectl-path=/k8s/bin/kubectl" in suite
    # The fake node's taint must not make the suite wait for that node to be schedulable.
    taints = next(f for f in suite if f.startswith("--non-blocking-taints="))
    assert conformance.TAINT_KEY in taints.split("=", 1)[1].split(",")


def test_focus_and_skip_narrow_both_phases(tmp_path: Path) -> None:
    b = Binaries("/k8s/bin", "/k8s/bin/kubelet", "/usr/bin/etcd")
    opts = conformance.Options(out=tmp_path, focus="Pods", skip="DNS")
    for phase in ("parallel", "serial"):
        ginkgo, _ = _flags(conformance.suite_argv(b, opts, phase))
        assert "--focus=Pods" in ginkgo and "--skip=DNS" in ginkgo


def test_suite_problem_names_the_missing_binary(tmp_path: Path) -> None:
    (tmp_path / "ginkgo").write_text("#!/bin/sh\n")
    (tmp_path / "ginkgo").chmod(0o755)
    problem = conformance.suite_problem(Binaries(str(tmp_path), "", ""))
    assert problem is not None and "e2e.test" in problem


def test_etcd_reports_progress_within_the_watch_cache_wait() -> None:
    """Else a watch from a resourceVersion the cache has not seen fails with "Too large resource
    version" after 3 s (Watchers, RuntimeClass and CRD field-selector specs, 2026-12-02)."""
    argv = configs.etcd_argv(Binaries("/k8s/bin", "/k8s/bin/kubelet", "/usr/bin/etcd"))
    flag = next(a for a in argv if a.startswith("--experimental-watch-progress-notify-interval="))
    value = flag.split("=", 1)[1]
    assert value.endswith("s") and not value.endswith("ms")
    assert 0 < float(value[:-1]) < configs.WATCH_CACHE_WAIT_SECONDS


def test_containerd_nodes_are_private_and_apart_from_the_shims() -> None:
    """The comparison's nodes: each its own name, socket, root, state, cgroup root and processes,
    none shared with another containerd node or with a cri-shim node's runtime."""
    ctrd = layout.CONTAINERD_NODES
    assert len(ctrd) == 2 and all(n.runtime == "containerd" for n in ctrd)
    for attr in ("name", "socket", "state_dir", "cgroup_root", "runtime_proc", "kubelet_proc", "dir"):
        values = [getattr(n, attr) for n in layout.ALL_NODES]
        assert len(set(values)) == len(values), attr
    # The cri-shim nodes keep the names the scenarios and the state files know.
    docker = layout.node("docker")
    assert (docker.name, docker.runtime_proc, docker.kubelet_proc) == (
        "crishim-docker",
        "cri-shim-docker",
        "kubelet-docker",
    )


def test_containerd_config_is_the_nodes_own(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    n = layout.CONTAINERD_NODES[1]
    monkeypatch.setattr(layout, "ROOT", tmp_path)  # NodeSpec.dir reads ROOT when asked
    text = Path(configs.containerd_config(n, "registry.k8s.io/pause:3.10.1")).read_text()
    cfg = tomllib.loads(text)
    assert cfg["grpc"]["address"] == str(n.socket)
    assert cfg["root"] == str(n.state_dir) and cfg["state"] == str(layout.RUN / n.name)
    cri = cfg["plugins"]["io.containerd.grpc.v1.cri"]
    assert cri["sandbox_image"] == "registry.k8s.io/pause:3.10.1"
    assert cri["cni"]["conf_dir"] == str(n.cni_conf_dir)  # where write_conflist puts the node's network
    assert cri["netns_mounts_under_state_dir"] is True  # not the host's /run/netns
    runc = cri["containerd"]["runtimes"]["runc"]["options"]
    assert runc["Root"].startswith(str(layout.RUN / n.name)) and runc["SystemdCgroup"] is False
    hosts = Path(cri["registry"]["config_path"], "127.0.0.1:5000", "hosts.toml").read_text()
    assert 'server = "http://127.0.0.1:5000"' in hosts


@pytest.mark.skipif(shutil.which("openssl") is None, reason="no openssl to make certificates")
def test_front_proxy_client_is_signed_by_its_own_ca(tmp_path: Path) -> None:
    """The aggregation layer (the Aggregator spec's sample API server): the API server proxies with
    a client certificate of the front-proxy CA, which extension API servers trust for the X-Remote-*
    headers, and not with one the cluster CA signed (any kubelet or admin certificate would do)."""
    pki.make_ca(tmp_path)
    pki.make_ca(tmp_path, pki.FRONT_PROXY_CA, "front-proxy-ca")
    pki.make_cert(tmp_path, pki.Identity("front-proxy-client", pki.FRONT_PROXY_CLIENT), ca=pki.FRONT_PROXY_CA)

    def verify(ca: str) -> subprocess.CompletedProcess[bytes]:
        argv = [
            "openssl",
            "verify",
            "-CAfile",
            str(tmp_path / f"{ca}.crt"),
            str(tmp_path / "front-proxy-client.crt"),
        ]
        return subprocess.run(argv, capture_output=True, check=False)

    assert verify(pki.FRONT_PROXY_CA).returncode == 0
    assert verify("ca").returncode != 0
    argv = configs.apiserver_argv(Binaries("/k8s/bin", "/k8s/bin/kubelet", "/usr/bin/etcd"))
    flags = dict(a[2:].split("=", 1) for a in argv[1:])
    assert Path(flags["requestheader-client-ca-file"]).name == f"{pki.FRONT_PROXY_CA}.crt"
    assert flags["requestheader-allowed-names"] == pki.FRONT_PROXY_CLIENT
    assert Path(flags["proxy-client-cert-file"]).name == "front-proxy-client.crt"
    assert Path(flags["proxy-client-key-file"]).name == "front-proxy-client.key"
