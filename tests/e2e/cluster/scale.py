"""Scale mode: N real kubelets, each on a hollow node of one `cri-shim hollow` process, under the
cluster's real control plane; a Deployment of P pods per node; what it costs and how long it takes.

The bring-up is `up`'s without the three nodes, kube-proxy and the cluster DNS (no pod here has a
process or a network to use them): certificates (one client certificate per hollow kubelet,
CN=system:node:hollow-I, as the three nodes'), the nodes' bridge with an address per hollow node
(172.30.0.100+I), a cgroup root per kubelet below ``/crishim-cluster-hollow`` in every hierarchy,
etcd, kube-apiserver, controller-manager, scheduler (`bringup.start_control_plane`), then ONE
``cri-shim hollow --nodes N`` and N kubelets v1.35, each with its own name, root directory,
podLogsDir, cgroup root, kubelet port (14000+I) and healthz port (15000+I), started together. The
fs.inotify.max_user_instances limit is raised for the run when it is below 128 + 8 per kubelet
(each kubelet holds several; `down` puts it back).

The run, sampled every 2 s (sampling.py): the N nodes Ready (bounded), an idle phase, then a
Deployment of N x P pause pods selected onto the hollow nodes (a topology spread of maxSkew 1
over hostnames: exactly P each), timed from the apply to all scheduled and to all Running as the
API server lists them (phase Running), then a steady phase. Pods mount no service-account token:
a hollow pod has no process to read it, and a kubelet would otherwise mount a tmpfs on the host
per pod. Figures are printed (nothing is asserted); `down` takes it all away.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import os
import ssl
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping
from datetime import datetime
from typing import Any

from tests.e2e.cluster import bringup, configs, hostnet, pki, procs, sampling
from tests.e2e.cluster import workloads as w
from tests.e2e.cluster.kubectl import Kubectl, node_ready, wait_for
from tests.e2e.cluster.layout import (
    APISERVER_PORT,
    CONTROL_IP,
    HOLLOW_DIR,
    HOLLOW_KUBELET_PREFIX,
    HOLLOW_LABELS,
    HOLLOW_MAX,
    HOLLOW_NAME,
    LOGS,
    ROOT,
    RUN,
    Binaries,
    HollowNode,
    hollow_nodes,
    hollow_ports,
)
from tests.e2e.kubelet import host as kubelet_host
from tests.e2e.kubelet.config import REPO

Log = Callable[[str], None]
NAMESPACE = "scale"
DEPLOYMENT = "scale"
# What the table reports, in its order: the state file's names, then the kubelets as a group.
COMPONENTS = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", HOLLOW_NAME)
TABLE_ACCEPT = "application/json;as=Table;v=v1;g=meta.k8s.io"


@dataclasses.dataclass(frozen=True)
class Options:
    nodes: int
    pods_per_node: int = 30
    rest: float = 30.0  # seconds of the idle phase (before the Deployment) and the steady one (after)
    ready_timeout: float = 300.0  # for every kubelet to be Ready
    running_timeout: float = 900.0  # for every pod to be Running
    interval: float = 2.0  # between samples

    def problem(self) -> str | None:
        if not 1 <= self.nodes <= HOLLOW_MAX:
            return f"--nodes must be 1..{HOLLOW_MAX} (the nodes' /24 holds no more)"
        if not 1 <= self.pods_per_node <= 100:
            return "--pods-per-node must be 1..100 (a kubelet takes 110 pods at most)"
        return None


def _log(msg: str) -> None:
    print(f"[scale {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def environment_problem(b: Binaries, opts: Options) -> str | None:
    problem = opts.problem() or bringup.environment_problem(b)
    if problem:
        return problem
    busy = [f"{who} {port}" for who, port in hollow_ports(opts.nodes).items() if bringup._port_taken(port)]
    return f"ports in use: {', '.join(busy[:5])}" if busy else None


# ------------------------------------------------------------ the API server, as the admin
class Api:
    """GETs to the API server with the admin's client certificate (lighter than kubectl per poll)."""

    def __init__(self) -> None:
        self.ctx: ssl.SSLContext = bringup.tls("admin")
        self.base = f"https://{CONTROL_IP}:{APISERVER_PORT}"

    def get(self, path: str, accept: str = "application/json", timeout: float = 60) -> Any:
        req = urllib.request.Request(self.base + path, headers={"Accept": accept})
        with urllib.request.urlopen(req, timeout=timeout, context=self.ctx) as resp:
            return json.loads(resp.read())

    def count_pods(self, namespace: str, field_selector: str = "") -> int:
        """How many pods match, listed as a table without objects (a row a pod, a few cells)."""
        q = urllib.parse.urlencode({"includeObject": "None", "fieldSelector": field_selector})
        table = self.get(f"/api/v1/namespaces/{namespace}/pods?{q}", accept=TABLE_ACCEPT)
        return len(table.get("rows") or [])


# ------------------------------------------------------------ manifests
def deployment(replicas: int, pause: str) -> dict[str, Any]:
    template = w.pod(
        DEPLOYMENT,
        w.container("pause", pause),
        labels={"app": DEPLOYMENT},
        nodeSelector=dict(HOLLOW_LABELS),
        automountServiceAccountToken=False,
        enableServiceLinks=False,
        topologySpreadConstraints=[
            {
                "maxSkew": 1,
                "topologyKey": "kubernetes.io/hostname",
                "whenUnsatisfiable": "DoNotSchedule",
                "labelSelector": {"matchLabels": {"app": DEPLOYMENT}},
            }
        ],
    )
    return w.deployment(DEPLOYMENT, replicas, template)


# ------------------------------------------------------------ bring-up
def up(b: Binaries, opts: Options, log: Log = _log, keep_on_failure: bool = False) -> list[HollowNode]:
    """The control plane, the hollow process and N kubelets, every node Ready; taken down again
    on a failure unless `keep_on_failure`."""
    problem = environment_problem(b, opts)
    if problem:
        raise RuntimeError(f"cannot bring the scale cluster up: {problem}")
    leftovers = bringup.check()
    if leftovers:
        raise RuntimeError("leftovers of an earlier cluster (run `down`):\n  " + "\n  ".join(leftovers))
    bringup.ensure_etcd(b, log)
    try:
        return _up(b, opts, log)
    except BaseException:
        if keep_on_failure:
            log(f"bring-up failed: keeping what came up (logs in {LOGS}); `down` takes it away")
        else:
            log("bring-up failed: taking down what came up")
            bringup.down(b, log, keep_logs=True)
        raise


def _up(b: Binaries, opts: Options, log: Log) -> list[HollowNode]:
    t0 = time.monotonic()
    timings: dict[str, float] = {}

    def mark(step: str) -> None:
        timings[step] = round(time.monotonic() - t0, 1)
        log(f"{step} ({timings[step]} s)")

    nodes = hollow_nodes(opts.nodes)
    for d in (ROOT, RUN, LOGS, HOLLOW_DIR):
        d.mkdir(parents=True, exist_ok=True)
    imgs = bringup.images()
    procs.update(mode="scale", hollow_nodes=opts.nodes, started_at=time.time(), images=imgs)
    kubelet_host.save_sysctls()
    procs.update(inotify_instances=hostnet.raise_inotify_instances(128 + 8 * opts.nodes))
    pki.make_all()
    pki.make_node_identities([n.name for n in nodes])
    mark("certificates")
    hostnet.make_node_bridge()
    hostnet.add_node_addresses([n.ip for n in nodes])
    hostnet.make_cgroup_roots(nodes)
    mark("host network and cgroup roots")
    bringup.start_control_plane(b, mark)

    procs.start(HOLLOW_NAME, configs.hollow_shim_argv(opts.nodes, imgs["pause"]), cwd=REPO)
    bringup.wait_daemon(HOLLOW_NAME, lambda: all(bringup.shim_answers(n) for n in nodes), 120)
    mark(f"{HOLLOW_NAME} serving {opts.nodes} nodes")

    kubelet = bringup._kubelet_binary(b)
    for n in nodes:
        for d in (n.kubelet_root, n.pod_logs):
            d.mkdir(parents=True, exist_ok=True)
        procs.start(n.proc_name, configs.kubelet_argv(n, kubelet))
    mark(f"{opts.nodes} kubelets started")
    api = Api()
    ready_at = _wait_nodes_ready(api, nodes, opts.ready_timeout, t0)
    mark(f"{opts.nodes} nodes Ready")
    procs.update(timings=timings, ready_at=ready_at)
    return nodes


def _wait_nodes_ready(api: Api, nodes: list[HollowNode], timeout: float, t0: float) -> dict[str, float]:
    """Seconds from `t0` to each node's Ready (as seen by a poll a second); a TimeoutError names the
    nodes that are not, with the end of their kubelets' logs."""
    want = {n.name for n in nodes}
    ready_at: dict[str, float] = {}
    deadline = time.monotonic() + timeout
    while True:
        for n in nodes:
            code = procs.exited(n.proc_name)
            if code is not None:
                raise RuntimeError(
                    f"kubelet of {n.name} exited ({code}): {bringup.tail(procs.log_path(n.proc_name))}"
                )
        try:
            items = api.get("/api/v1/nodes", timeout=30)["items"]
        except OSError:
            items = []
        for node in items:
            name = node["metadata"]["name"]
            if name in want and name not in ready_at and node_ready(node):
                ready_at[name] = round(time.monotonic() - t0, 1)
        if len(ready_at) == len(want):
            return ready_at
        if time.monotonic() >= deadline:
            missing = sorted(want - set(ready_at), key=lambda s: int(s.split("-")[1]))
            first = next(n for n in nodes if n.name == missing[0])
            raise TimeoutError(
                f"{len(missing)} of {len(want)} nodes not Ready after {timeout:.0f} s "
                f"({', '.join(missing[:10])}); {first.name}'s kubelet:\n"
                f"{bringup.tail(procs.log_path(first.proc_name))}"
            )
        time.sleep(1)


# ------------------------------------------------------------ the run
def _targets() -> dict[str, tuple[int, int | None]]:
    return {name: (rec["pid"], rec["start"]) for name, rec in procs.load()["procs"].items()}


def rfc3339(stamp: str) -> float:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def percentiles(values: list[float]) -> dict[str, float]:
    """p50, p90, p99 and max (nearest rank), or nothing for no values."""
    if not values:
        return {}
    v = sorted(values)

    def rank(p: float) -> float:
        return v[min(len(v), max(1, math.ceil(p / 100 * len(v)))) - 1]

    return {"p50": rank(50), "p90": rank(90), "p99": rank(99), "max": v[-1]}


def pod_latencies(pods: list[dict[str, Any]]) -> dict[str, Any]:
    """From each pod's own record: seconds from its creation to scheduled and to Ready (the API
    keeps whole seconds), and how many pods each node got."""
    scheduled, ready, creations = [], [], []
    per_node: collections.Counter[str] = collections.Counter()
    for p in pods:
        created = rfc3339(p["metadata"]["creationTimestamp"])
        creations.append(created)
        per_node[p.get("spec", {}).get("nodeName") or "<none>"] += 1
        for c in p.get("status", {}).get("conditions") or []:
            if c.get("status") != "True" or not c.get("lastTransitionTime"):
                continue
            if c["type"] == "PodScheduled":
                scheduled.append(rfc3339(c["lastTransitionTime"]) - created)
            elif c["type"] == "Ready":
                ready.append(rfc3339(c["lastTransitionTime"]) - created)
    counts = list(per_node.values())
    return {
        "to_scheduled": percentiles(scheduled),
        "to_ready": percentiles(ready),
        "pods_per_node": {"min": min(counts), "max": max(counts)} if counts else {},
        "unscheduled": per_node.get("<none>", 0),
        # From the first pod's creation to the last's: how fast the ReplicaSet controller made them.
        "creation_span": max(creations) - min(creations) if creations else None,
    }


def _rollout(api: Api, k: Kubectl, opts: Options, pause: str, log: Log) -> dict[str, Any]:
    """Apply the Deployment; poll until every pod is Running; seconds from the apply to all
    scheduled, half, 90 % and all Running."""
    total = opts.nodes * opts.pods_per_node
    t0 = time.monotonic()
    k.apply(deployment(total, pause), namespace=NAMESPACE)
    applied = time.monotonic() - t0
    out: dict[str, Any] = {"pods": total, "apply_seconds": round(applied, 2)}
    progress: list[tuple[float, int, int]] = []
    deadline = t0 + opts.running_timeout
    last_log = 0.0
    while True:
        now = time.monotonic() - t0
        try:
            scheduled = api.count_pods(NAMESPACE, "spec.nodeName!=")
            running = api.count_pods(NAMESPACE, "status.phase=Running")
        except OSError as exc:
            log(f"listing pods failed: {exc}")
            scheduled = running = -1
        if running >= 0:
            progress.append((round(now, 1), scheduled, running))
            if "all_scheduled" not in out and scheduled >= total:
                out["all_scheduled"] = round(now, 1)
            for key, frac in (("half_running", 0.5), ("p90_running", 0.9)):
                if key not in out and running >= frac * total:
                    out[key] = round(now, 1)
            if running >= total:
                out["all_running"] = round(now, 1)
                break
        if now - last_log >= 15:
            log(f"{now:.0f} s: {scheduled} scheduled, {running} Running of {total}")
            last_log = now
        if time.monotonic() >= deadline:
            out["timed_out"] = True
            log(f"not all Running after {opts.running_timeout:.0f} s: {running} of {total}")
            break
        time.sleep(1)
    out["progress"] = progress
    return out


def run(b: Binaries, opts: Options, log: Log = _log, keep: bool = False) -> dict[str, Any]:
    """Bring the scale cluster up, measure, take it down (unless `keep`); the figures as a dict."""
    t_up = time.monotonic()
    up(b, opts, log)
    result: dict[str, Any] = {
        "nodes": opts.nodes,
        "pods_per_node": opts.pods_per_node,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "ncpu": os.cpu_count(),
    }
    try:
        state = procs.load()
        result["up_timings"] = state.get("timings", {})
        ready_at = state.get("ready_at", {})
        result["nodes_ready_seconds"] = max(ready_at.values()) if ready_at else None
        result["up_seconds"] = round(time.monotonic() - t_up, 1)
        api, k = Api(), Kubectl(b)
        k.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}})
        # Pods are refused until the controller-manager made the namespace's ServiceAccount.
        wait_for("ServiceAccount default", lambda: k.get("serviceaccount", "default", NAMESPACE), 60)
        with open("/proc/loadavg") as fh:
            result["loadavg_before"] = fh.read().split()[:3]
        with sampling.Sampler(_targets, opts.interval) as sampler:
            sampler.mark("idle-start")
            time.sleep(opts.rest)
            sampler.mark("idle-end")
            sampler.mark("rollout-start")
            result["rollout"] = _rollout(api, k, opts, procs.load()["images"]["pause"], log)
            sampler.mark("rollout-end")
            time.sleep(opts.rest)
            sampler.mark("steady-end")
        with open("/proc/loadavg") as fh:
            result["loadavg_after"] = fh.read().split()[:3]
        pods = api.get(f"/api/v1/namespaces/{NAMESPACE}/pods", timeout=120)["items"]
        result["per_pod"] = pod_latencies(pods)
        result["phases"] = phases(sampler)
    finally:
        if not keep:
            left = bringup.down(b, log, keep_logs="rollout" not in result)
            result["left_after_down"] = left
    return result


def phases(sampler: sampling.Sampler) -> dict[str, Any]:
    """Per phase: each component's CPU and RSS, the kubelets as a group, the host."""
    m = sampler.marks
    windows = {
        "idle": (m["idle-start"], m["idle-end"]),
        "rollout": (m["rollout-start"], m["rollout-end"]),
        "steady": (m["rollout-end"], m["steady-end"]),
    }
    out: dict[str, Any] = {}
    for phase, (start, end) in windows.items():
        per = sampling.usage(sampler.samples, start, end)
        host = sampling.host_usage(sampler.samples, start, end)
        kubelets = sampling.group(per, HOLLOW_KUBELET_PREFIX)
        out[phase] = {
            "seconds": round(end - start, 1),
            "components": {n: dataclasses.asdict(per[n]) for n in COMPONENTS if n in per},
            "kubelets": dataclasses.asdict(kubelets) if kubelets else None,
            "host": dataclasses.asdict(host) if host else None,
        }
    return out


# ------------------------------------------------------------ the table
def table(result: Mapping[str, Any]) -> str:
    """The figures of one run as text: a headline, then CPU (% of one core) and RSS (MiB) per phase."""
    r = result
    ro = r.get("rollout", {})
    pp = r.get("per_pod", {})
    lines = [
        f"scale run {r['date']}: {r['nodes']} hollow nodes x {r['pods_per_node']} pods = "
        f"{r['nodes'] * r['pods_per_node']} pods, {r['ncpu']} CPUs",
        f"load average before {' '.join(r.get('loadavg_before', []))}, after {' '.join(r.get('loadavg_after', []))}",
        f"up {r.get('up_seconds')} s; every node Ready {r.get('nodes_ready_seconds')} s after the start",
        f"Deployment apply -> all scheduled {ro.get('all_scheduled')} s, half Running {ro.get('half_running')} s, "
        f"90 % {ro.get('p90_running')} s, all Running {ro.get('all_running')} s"
        + (" (TIMED OUT)" if ro.get("timed_out") else ""),
        f"per pod, creation -> Ready (s): {_pcts(pp.get('to_ready', {}))}; -> scheduled: "
        f"{_pcts(pp.get('to_scheduled', {}))}; pods per node {pp.get('pods_per_node')}; "
        f"first to last pod created {pp.get('creation_span')} s",
    ]
    ph = r.get("phases", {})
    if not ph:
        return "\n".join(lines)
    names = ("idle", "rollout", "steady")
    lines.append("")
    lines.append(
        "| process | "
        + " | ".join(f"{p} CPU %" for p in names)
        + " | "
        + " | ".join(f"{p} RSS MiB" for p in names)
        + " |"
    )
    lines.append("| --- " * (1 + 2 * len(names)) + "|")
    for comp in COMPONENTS:
        cells = [fmt(ph[p]["components"].get(comp, {}).get("cpu")) for p in names]
        cells += [fmt(ph[p]["components"].get(comp, {}).get("rss_max"), 0) for p in names]
        lines.append(f"| {comp} | " + " | ".join(cells) + " |")
    for label, cpu_key, rss_key in (
        ("kubelets, sum", "cpu_sum", "rss_sum"),
        ("one kubelet, mean", "cpu_mean", "rss_mean"),
        ("one kubelet, max", "cpu_max", "rss_max"),
    ):
        cells = [fmt((ph[p]["kubelets"] or {}).get(cpu_key)) for p in names]
        cells += [fmt((ph[p]["kubelets"] or {}).get(rss_key), 0) for p in names]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    host = [ph[p]["host"] or {} for p in names]
    lines.append(
        "| host busy / steal, % of all CPUs | "
        + " | ".join(f"{fmt(h.get('busy'))} / {fmt(h.get('steal'))}" for h in host)
        + " | "
        + " | ".join(f"avail {fmt(h.get('mem_available_min'), 0)}" for h in host)
        + " |"
    )
    return "\n".join(lines)


def fmt(v: float | None, digits: int = 1) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def _pcts(p: Mapping[str, float]) -> str:
    return ", ".join(f"{k} {v:.0f}" for k, v in p.items()) or "-"


def summary_row(r: Mapping[str, Any]) -> dict[str, Any]:
    """One line of a sweep: N, the rollout's time, the steady phase's costs."""
    steady = r.get("phases", {}).get("steady", {})
    comps = steady.get("components", {})
    kub = steady.get("kubelets") or {}
    return {
        "nodes": r["nodes"],
        "pods": r["nodes"] * r["pods_per_node"],
        "ready_s": r.get("nodes_ready_seconds"),
        "all_running_s": r.get("rollout", {}).get("all_running"),
        "timed_out": bool(r.get("rollout", {}).get("timed_out")),
        "apiserver_cpu": comps.get("kube-apiserver", {}).get("cpu"),
        "apiserver_rss": comps.get("kube-apiserver", {}).get("rss_max"),
        "kubelets_cpu": kub.get("cpu_sum"),
        "kubelet_rss_mean": kub.get("rss_mean"),
        "hollow_cpu": comps.get(HOLLOW_NAME, {}).get("cpu"),
        "host_busy": (steady.get("host") or {}).get("busy"),
        "mem_available_min": (steady.get("host") or {}).get("mem_available_min"),
    }
