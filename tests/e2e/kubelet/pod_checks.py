"""The static-pod checks: what the kubelet makes of its pods through the CRI.

Read from the kubelet's ``/pods`` API (which shows static pods' statuses)
and, for the teardown, from the shim's own CRI.
"""

from __future__ import annotations

import json
import time
from typing import Any

from cri_api import api_pb2 as pb
from tests.e2e.kubelet.checks import CheckFailed, Result, check, passed
from tests.e2e.kubelet.pods import describe
from tests.e2e.kubelet.runner import Harness


@check("pod", 1)
def check_pod_network(h: Harness) -> Result:
    """a pod-network pod is Running with a pod IP"""
    s = h.wait_running("net", "main")
    pod = h.kubelet_pods()[h.full("net")]
    deadline = time.monotonic() + 15
    while not pod["status"].get("podIP") or pod["status"].get("phase") != "Running":
        if time.monotonic() > deadline:
            raise CheckFailed(f"phase {pod['status'].get('phase')}, podIP {pod['status'].get('podIP')!r}")
        time.sleep(1)
        pod = h.kubelet_pods()[h.full("net")]
    return passed(
        f"Running, podIP {pod['status']['podIP']}, started {s['state']['running'].get('startedAt')}"
    )


@check("pod", 2)
def check_host_network(h: Harness) -> Result:
    """a hostNetwork pod is Running (runv qemu: refused, as a VM has its own network)"""
    if h.driver == "qemu":
        refusal = "does not support host networking"
        pod = h.kubelet_pods().get(h.full("hostnet"), {})
        if pod.get("status", {}).get("phase") == "Running":
            raise CheckFailed("a host-network pod runs on the qemu driver")
        if refusal not in h.shim_log.read_text(errors="replace"):
            raise CheckFailed(f"no RunPodSandbox refusal ({refusal!r}) in the shim's log")
        return passed(
            f"refused as designed (UNIMPLEMENTED: {refusal}); phase {pod.get('status', {}).get('phase')}"
        )
    h.wait_running("hostnet", "main")
    pod = h.kubelet_pods()[h.full("hostnet")]
    detail = f"phase {pod['status'].get('phase')}, podIP {pod['status'].get('podIP', '')!r}"
    if h.handler == "docker" and h.warm:
        # The shim's pool holds pause containers for such pods: this one must have taken one.
        items = h.cri().ListPodSandbox(pb.ListPodSandboxRequest(), timeout=10).items
        ready = [s for s in items if s.metadata.name == h.full("hostnet") and s.state == pb.SANDBOX_READY]
        if not ready:
            raise CheckFailed("no ready sandbox of the host-network pod in ListPodSandbox")
        req = pb.PodSandboxStatusRequest(pod_sandbox_id=ready[0].id, verbose=True)
        info = json.loads(h.cri().PodSandboxStatus(req, timeout=10).info["info"])
        warm_id = info.get("backend_data", {}).get("warm_id")
        if not warm_id:
            raise CheckFailed("the host-network pod started cold although the pool holds pause containers")
        detail += f", took warm pause container {warm_id}"
    return passed(detail)


@check("pod", 3)
def check_init_container(h: Harness) -> Result:
    """an init container completes before the app container starts"""
    app = h.wait_running("init", "app")
    init = h.wait_container("init", "init", lambda s: "terminated" in s.get("state", {}), 10, init=True)
    term = init["state"]["terminated"]
    if term.get("exitCode") != 0:
        raise CheckFailed(f"init container: {describe(init)}")
    finished, started = term.get("finishedAt", ""), app["state"]["running"].get("startedAt", "")
    if not finished or not started or started < finished:
        raise CheckFailed(f"app started {started} before the init container finished {finished}")
    return passed(f"init {term.get('reason')} at {finished}; app started {started}")


@check("pod", 4)
def check_empty_dir(h: Harness) -> Result:
    """an emptyDir is shared between the init and the app container"""
    h.wait_log("init", "app", "init-done")
    return passed("app's log shows the init container's marker: init-done")


@check("pod", 5, timeout=60)
def check_crash_loop(h: Harness) -> Result:
    """a crashing container is restarted, lastState exit code 3"""

    def restarted(s: dict[str, Any]) -> bool:
        return s.get("restartCount", 0) >= 1 and "terminated" in (s.get("lastState") or {})

    s = h.wait_container("crash", "main", restarted, 50, tolerate=frozenset({"CrashLoopBackOff"}))
    code = s["lastState"]["terminated"].get("exitCode")
    if code != 3:
        raise CheckFailed(f"lastState.terminated.exitCode {code}, want 3: {describe(s)}")
    return passed(f"restartCount {s['restartCount']}, lastState exit 3, now {describe(s)}")


@check("pod", 6)
def check_etc_hosts(h: Harness) -> Result:
    """the kubelet's /etc/hosts is mounted (the pod's hostname in it)"""
    text = h.wait_log("etchosts", "main", h.full("etchosts"))
    header = "Kubernetes-managed hosts file" in text
    return passed(f"/etc/hosts names {h.full('etchosts')}" + (", kubelet-managed header" if header else ""))


@check("pod", 7)
def check_termination_message(h: Harness) -> Result:
    """a termination message written to /dev/termination-log, or (FallbackToLogsOnError) the last
    output of a failed container, is in the status"""
    s = h.wait_container("termmsg", "main", lambda s: "terminated" in s.get("state", {}), 20)
    term = s["state"]["terminated"]
    if term.get("message", "") != "bye-from-termlog":
        raise CheckFailed(f"message {term.get('message')!r}, want 'bye-from-termlog'; {describe(s)}")
    s = h.wait_container("termlog", "main", lambda s: "terminated" in s.get("state", {}), 20)
    fallback = s["state"]["terminated"]
    if fallback.get("message", "") != "DONE":
        raise CheckFailed(f"from the log: message {fallback.get('message')!r}, want 'DONE'; {describe(s)}")
    return passed(
        f"terminated exit {term.get('exitCode')}, message {term['message']!r}; "
        f"from the log after exit {fallback.get('exitCode')}: {fallback['message']!r}"
    )


@check("pod", 8)
def check_hostpath_volume(h: Harness) -> Result:
    """a hostPath volume's file is read by the container"""
    h.wait_log("hostpath", "main", h.host_token)
    return passed(f"container read {h.host_token!r} from {h.hostdir}/hello.txt")


@check("pod", 9)
def check_two_containers(h: Harness) -> Result:
    """a pod with two containers has both Running"""
    h.wait_running("two", "sleeper")
    h.wait_running("two", "httpd")
    return passed("sleeper and httpd Running")


@check("pod", 10, when=lambda h: h.stop_signals)
def check_stop_signal(h: Harness) -> Result:
    """the stop signal the runtime reports is in the pod status (v1.33+, ContainerStopSignals):
    the container's lifecycle.stopSignal, else the image's (busybox: none, so SIGTERM)"""
    got = {}
    for name, want in (("usr1", "SIGUSR1"), ("default", "SIGTERM")):
        h.wait_running("stopsig", name)
        s = h.wait_container("stopsig", name, lambda s: bool(s.get("stopSignal")), 20)
        got[name] = s.get("stopSignal")
        if got[name] != want:
            raise CheckFailed(f"container {name}: stopSignal {got[name]!r}, want {want!r}")
    return passed(f"stopSignal usr1 {got['usr1']}, default {got['default']}")


# Slow (the kubelet's garbage collector runs once a minute): begun first, judged last.
@check("pod", 11, timeout=130, begin=Harness.begin_teardown)
def check_teardown(h: Harness) -> Result:
    """a removed manifest's pod and containers leave the runtime"""
    t = h.begin_teardown()
    sandboxes, containers = t.before
    if not sandboxes:
        raise CheckFailed("the teardown pod had no sandbox in the runtime before its removal")
    assert t.thread is not None
    t.thread.join(max(0.0, t.started + 125 - time.monotonic()))
    stopped = f"stopped after {t.stopped_after:.0f} s" if t.stopped_after is not None else "never stopped"
    if t.removed_after is None:
        raise CheckFailed(
            f"{t.error or stopped}; still in the runtime after 120 s: sandboxes {t.left[0]} "
            f"containers {t.left[1]}"
        )
    return passed(
        f"{len(sandboxes)} sandbox(es), {len(containers)} container(s): {stopped}, "
        f"removed after {t.removed_after:.0f} s (the kubelet's GC runs once a minute)"
    )
