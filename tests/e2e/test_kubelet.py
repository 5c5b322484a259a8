"""A real kubelet (v1.26, standalone, static pods) on a private cri-shim, per handler.

Each test runs every check of the tests/e2e/kubelet package that applies to
it (about a minute: the kubelet's garbage collector, which the teardown check
waits for, runs once a minute); docker-cni and runv-cni put the pods on a CNI network of
the run's own (Debian's plugins) and adds the cni-* checks. Opt-in: run only
when CRI_SHIM_KUBELET names a kubelet binary, since
the kubelet changes host kernel settings while it runs (the harness puts them
back); skipped, also in CI, without it, root or the local registry.
"""

from __future__ import annotations

import io
import os

import pytest

from tests.e2e import kubelet as kh

# The fake backend runs no processes: a container's command runs in its
# built-in shell. Asserted there: what the kubelet does with pods, statuses
# and restarts, ExecSync's built-in echo, and port-forward to the pod's
# busybox httpd (the shell's, serving the container's files). The other
# checks still run and are reported.
FAKE_ASSERTED = {
    "pod-pod-network",
    "pod-host-network",
    "pod-init-container",
    "pod-crash-loop",
    "pod-two-containers",
    "pod-teardown",
    "api-pods",
    "api-running-pods",
    "api-run",
    "api-port-forward-websocket",
}


RUNS = [(handler, False) for handler in kh.HANDLERS] + [("docker", True), ("runv", True)]


@pytest.mark.slow
@pytest.mark.timeout(480)
@pytest.mark.parametrize(
    ("handler", "cni"), RUNS, ids=[f"{handler}-cni" if cni else handler for handler, cni in RUNS]
)
def test_kubelet_end_to_end(handler: str, cni: bool) -> None:
    if not os.environ.get("CRI_SHIM_KUBELET"):
        pytest.skip("set CRI_SHIM_KUBELET to a kubelet binary to run the kubelet end-to-end checks")
    problem = kh.environment_problem(handler, cni=cni)
    if problem:
        pytest.skip(problem)
    out = io.StringIO()
    results, h = kh.run(handler, out=out, cni=cni)
    print(out.getvalue())
    applicable = {c.name for c in kh.applicable(h)}
    assert {c.name for c, _, _ in results} == applicable
    assert any(name.startswith("cni-") for name in applicable) == cni
    asserted = FAKE_ASSERTED if handler == "fake" else applicable
    failed = [f"{c.name}: {r.reason}" for c, r, _ in results if c.name in asserted and not r.ok]
    assert not failed, "\n".join(failed) + "\n" + out.getvalue()


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("handler", ["runv", "docker"])
def test_kubelet_pod_cgroups(handler: str) -> None:
    """With the kubelet's own pod cgroups (cgroupsPerQOS): the pod-level usage of /stats/summary
    counts what runs in the pod (for runv: its VM, which runs below the pod's cgroup)."""
    if not os.environ.get("CRI_SHIM_KUBELET"):
        pytest.skip("set CRI_SHIM_KUBELET to a kubelet binary to run the kubelet end-to-end checks")
    problem = kh.environment_problem(handler)
    if problem:
        pytest.skip(problem)
    out = io.StringIO()
    names = {"pod-pod-network", "api-pod-usage"}
    results, _ = kh.run(handler, out=out, names=names, qos=True)
    print(out.getvalue())
    assert {c.name for c, _, _ in results} == names
    failed = [f"{c.name}: {r.reason}" for c, r, _ in results if not r.ok]
    assert not failed, "\n".join(failed) + "\n" + out.getvalue()
