"""The cluster harness's scale mode (tests/e2e/cluster/scale.py, sampling.py): hollow nodes under a
real API server.

Most of it runs without Kubernetes: the hollow nodes' layout and files, the hollow process's
command line as the shim parses it, the cgroup roots and inotify limit on stand-in files, the
/proc parsing and the arithmetic of the figures, the Deployment and the table. The last test is
opt-in (root and CRI_SHIM_K8S_BIN_DIR): a real run at 3 nodes x 5 pods, then nothing left.
"""

from __future__ import annotations

import ipaddress
import json
import os
from pathlib import Path
from typing import Any

import pytest

from shim import cli
from shim.config import load
from tests.e2e.cluster import bringup, configs, hostnet, layout, sampling, scale
from tests.e2e.cluster.layout import HollowNode, hollow_nodes, hollow_ports
from tests.e2e.kubelet.config import shim_command


# ------------------------------------------------------------ layout and files
def test_hollow_nodes_have_their_own_addresses_ports_directories_and_cgroup_roots() -> None:
    nodes = hollow_nodes(layout.HOLLOW_MAX)
    for attr in ("name", "ip", "port", "healthz_port", "dir", "socket", "cgroup_root", "proc_name"):
        values = [getattr(n, attr) for n in nodes]
        assert len(set(values)) == len(nodes), attr
    net = ipaddress.ip_network(layout.NODE_NET)
    taken = {layout.CONTROL_IP, *(n.ip for n in layout.NODES)}
    assert all(ipaddress.ip_address(n.ip) in net and n.ip not in taken for n in nodes)
    # Neither the cluster's own ports nor the machine's kubelet and API server ports.
    ports = set(hollow_ports(layout.HOLLOW_MAX).values())
    assert len(ports) == 2 * layout.HOLLOW_MAX
    assert not ports & set(layout.ports().values())
    assert not ports & {6443, 10248, 10250, 10255}
    assert all(n.cgroup_root.startswith(f"/{layout.HOLLOW_CGROUP}/") for n in nodes)
    # The hollow process names node i's socket by the same template.
    assert nodes[7].socket == Path(layout.HOLLOW_SOCKET_TEMPLATE.replace("{i}", "7"))


@pytest.mark.parametrize("index", [-1, layout.HOLLOW_MAX], ids=["negative", "past-the-24"])
def test_a_hollow_node_outside_the_nodes_network_is_refused(index: int) -> None:
    with pytest.raises(ValueError, match="outside"):
        HollowNode(index)


def test_a_hollow_kubelet_config_is_its_own(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(layout, "HOLLOW_DIR", tmp_path)
    n = HollowNode(3)
    cfg = json.loads(Path(configs.kubelet_config(n)).read_text())
    assert cfg["address"] == "172.30.0.103" and cfg["port"] == 14003 and cfg["healthzPort"] == 15003
    assert cfg["containerRuntimeEndpoint"] == f"unix://{layout.RUN}/hollow-3.sock"
    assert cfg["cgroupRoot"] == "/crishim-cluster-hollow/hollow-3"
    assert cfg["podLogsDir"] == str(tmp_path / "hollow-3" / "pod-logs")
    argv = configs.kubelet_argv(n, "/bin/kubelet")
    assert "--hostname-override=hollow-3" in argv
    assert f"--kubeconfig={layout.PKI}/node-hollow-3.kubeconfig" in argv
    assert f"--root-dir={tmp_path}/hollow-3/kubelet" in argv
    assert "--node-labels=cri-shim.io/hollow=true" in argv


def test_the_hollow_process_command_line_is_one_the_shim_accepts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(configs, "HOLLOW_DIR", tmp_path)
    argv = configs.hollow_shim_argv(12, "127.0.0.1:5000/pause:3.10")
    args = cli._parser().parse_args(argv[len(shim_command()) :])
    assert args.command == "hollow" and args.nodes == 12
    assert args.socket_template == layout.HOLLOW_SOCKET_TEMPLATE and "{i}" in args.socket_template
    cfg = load(args.config)
    assert set(cfg.handlers) == {"fake"} and cfg.handlers["fake"].type == "fake"
    assert cfg.images.pause_image == "127.0.0.1:5000/pause:3.10"
    assert not cfg.nri.enable


def test_hollow_cgroup_roots_in_every_hierarchy_with_cpusets_that_can_hold_tasks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cpuset, memory = tmp_path / "cpuset", tmp_path / "memory"
    for h in (cpuset, memory):
        h.mkdir()
    (cpuset / "cpuset.cpus").write_text("0-1\n")
    (cpuset / "cpuset.mems").write_text("0\n")
    monkeypatch.setattr(hostnet, "hierarchies", lambda: [cpuset, memory])
    nodes = hollow_nodes(2)
    hostnet.make_cgroup_roots(nodes)
    for h in (cpuset, memory):
        for n in nodes:
            assert (h / n.cgroup_root.strip("/")).is_dir()
    assert (cpuset / "crishim-cluster-hollow" / "hollow-1" / "cpuset.cpus").read_text() == "0-1\n"
    assert {d.name for d in hostnet.cgroup_dirs()} == {"crishim-cluster-hollow"}
    hostnet.remove_cgroups()  # rmdir, deepest first (a real cpuset's files go with their directory)
    assert not (memory / "crishim-cluster-hollow").exists()


def test_the_inotify_limit_is_raised_for_the_run_and_put_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    f = tmp_path / "max_user_instances"
    f.write_text("128\n")
    monkeypatch.setattr(hostnet, "INOTIFY_INSTANCES", f)
    assert hostnet.raise_inotify_instances(100) is None  # high enough already: left alone
    saved = hostnet.raise_inotify_instances(448)
    assert saved == {"before": 128, "set": 448} and f.read_text() == "448"
    hostnet.restore_inotify_instances(saved)
    assert f.read_text() == "128"
    # Changed by someone else since: theirs is kept.
    saved = hostnet.raise_inotify_instances(448)
    f.write_text("1024")
    hostnet.restore_inotify_instances(saved)
    assert f.read_text() == "1024"


# ------------------------------------------------------------ /proc and the figures
STAT = (
    "4242 (kube (api) server) S 1 4242 4242 0 -1 4194560 5000 0 0 0 "
    "150 50 0 0 20 0 12 0 987654 1234567890 25600 18446744073709551615"
)


def test_stat_fields_count_from_the_last_parenthesis() -> None:
    s = sampling.parse_stat(STAT)
    assert s.ticks == 200 and s.start == 987654 and s.rss == 25600 * sampling.PAGE


def test_host_figures_from_proc_stat_meminfo_and_loadavg() -> None:
    h = sampling.parse_host(
        "cpu  100 10 50 800 20 5 5 10 0 0\ncpu0 1 2 3 4 5 6 7 8 0 0\n",
        "MemTotal:       24000000 kB\nMemAvailable:   20000000 kB\n",
        "3.52 2.10 1.00 4/900 12345\n",
    )
    assert (h.busy, h.steal, h.total) == (170, 10, 1000)
    assert h.mem_available == 20000000 * 1024 and h.load1 == 3.52


def _sample(
    t: float, ticks: dict[str, int], rss_mib: dict[str, int], busy: int, total: int
) -> sampling.Sample:
    procs = {
        name: sampling.ProcSample(ticks=v, rss=rss_mib[name] * sampling.MIB, start=1)
        for name, v in ticks.items()
    }
    return sampling.Sample(t, procs, sampling.HostSample(busy, 0, total, 1000 * sampling.MIB, 1.0))


def test_cpu_over_a_window_is_the_tick_difference_over_its_length() -> None:
    tck = sampling.CLK_TCK
    samples = [
        _sample(0, {"etcd": 0, "kubelet-hollow-0": 0}, {"etcd": 10, "kubelet-hollow-0": 50}, 0, 0),
        _sample(10, {"etcd": 5 * tck, "kubelet-hollow-0": tck}, {"etcd": 30, "kubelet-hollow-0": 60}, 0, 0),
        _sample(
            20, {"etcd": 10 * tck, "kubelet-hollow-0": 2 * tck}, {"etcd": 20, "kubelet-hollow-0": 55}, 0, 0
        ),
        _sample(30, {"etcd": 30 * tck}, {"etcd": 20}, 0, 0),  # the kubelet gone: outside its figures
    ]
    u = sampling.usage(samples, 0, 20)
    assert u["etcd"].cpu == pytest.approx(50.0) and u["etcd"].rss_max == 30
    assert u["kubelet-hollow-0"].cpu == pytest.approx(10.0) and u["kubelet-hollow-0"].rss_max == 60
    assert set(sampling.usage(samples, 0, 30)) == {"etcd"}
    assert sampling.usage(samples, 5, 15) == {}  # one sample is no window


def test_a_reused_pid_is_not_counted_as_the_same_process() -> None:
    a = sampling.Sample(0, {"x": sampling.ProcSample(100, 0, start=1)}, sampling.HostSample(0, 0, 0, 0, 0))
    b = sampling.Sample(5, {"x": sampling.ProcSample(10, 0, start=2)}, sampling.HostSample(0, 0, 0, 0, 0))
    assert sampling.usage([a, b], 0, 5) == {}


def test_kubelets_as_a_group_and_the_host() -> None:
    per = {
        "kubelet-hollow-0": sampling.Usage(cpu=2.0, rss_max=60),
        "kubelet-hollow-1": sampling.Usage(cpu=4.0, rss_max=80),
        "etcd": sampling.Usage(cpu=9.0, rss_max=100),
    }
    g = sampling.group(per, "kubelet-hollow-")
    assert g is not None
    assert (g.count, g.cpu_sum, g.cpu_mean, g.cpu_max, g.rss_sum, g.rss_mean, g.rss_max) == (
        2, 6.0, 3.0, 4.0, 140, 70, 80
    )  # fmt: skip
    assert sampling.group(per, "nothing-") is None
    host = sampling.host_usage([_sample(0, {}, {}, 100, 1000), _sample(10, {}, {}, 400, 2000)], 0, 10)
    assert host is not None and host.busy == pytest.approx(30.0) and host.mem_available_min == 1000


def test_a_sampler_reads_this_process_and_only_the_recorded_start() -> None:
    me = os.getpid()
    start = sampling.read_proc(me)
    assert start is not None
    s = sampling.Sampler(lambda: {"me": (me, start.start), "other": (me, start.start + 1)}, 0.01)
    with s:
        s.mark("a")
        sum(range(200000))
        s.mark("b")
    assert "me" in s.samples[-1].procs and "other" not in s.samples[-1].procs
    assert s.marks["b"] >= s.marks["a"]


@pytest.mark.parametrize(
    ("values", "want"),
    [
        ([], {}),
        ([3.0], {"p50": 3.0, "p90": 3.0, "p99": 3.0, "max": 3.0}),
        ([float(i) for i in range(1, 101)], {"p50": 50.0, "p90": 90.0, "p99": 99.0, "max": 100.0}),
    ],
    ids=["none", "one", "hundred"],
)
def test_percentiles_by_nearest_rank(values: list[float], want: dict[str, float]) -> None:
    assert scale.percentiles(values) == want


def _pod(node: str, created: str, scheduled: str, ready: str | None) -> dict[str, Any]:
    conds = [{"type": "PodScheduled", "status": "True", "lastTransitionTime": scheduled}]
    conds.append(
        {"type": "Ready", "status": "True" if ready else "False", "lastTransitionTime": ready or scheduled}
    )
    return {
        "metadata": {"creationTimestamp": created},
        "spec": {"nodeName": node},
        "status": {"conditions": conds},
    }


def test_pod_latencies_from_their_conditions() -> None:
    pods = [
        _pod("hollow-0", "2026-12-03T20:00:00Z", "2026-12-03T20:00:01Z", "2026-12-03T20:00:04Z"),
        _pod("hollow-0", "2026-12-03T20:00:00Z", "2026-12-03T20:00:02Z", "2026-12-03T20:00:10Z"),
        _pod("hollow-1", "2026-12-03T20:00:01Z", "2026-12-03T20:00:02Z", None),  # not Ready: no figure
    ]
    got = scale.pod_latencies(pods)
    assert got["to_scheduled"]["max"] == 2 and got["to_scheduled"]["p50"] == 1
    assert got["to_ready"] == {"p50": 4.0, "p90": 10.0, "p99": 10.0, "max": 10.0}
    assert got["pods_per_node"] == {"min": 1, "max": 2} and got["unscheduled"] == 0
    assert got["creation_span"] == 1


def test_the_deployment_spreads_tokenless_pods_over_the_hollow_nodes_only() -> None:
    d = scale.deployment(90, "127.0.0.1:5000/pause:3.10")
    spec = d["spec"]["template"]["spec"]
    assert d["spec"]["replicas"] == 90
    assert spec["nodeSelector"] == layout.HOLLOW_LABELS
    assert spec["automountServiceAccountToken"] is False
    (spread,) = spec["topologySpreadConstraints"]
    assert spread["maxSkew"] == 1 and spread["whenUnsatisfiable"] == "DoNotSchedule"
    assert spread["topologyKey"] == "kubernetes.io/hostname"
    assert spread["labelSelector"]["matchLabels"] == d["spec"]["selector"]["matchLabels"]
    assert spec["containers"][0]["image"] == "127.0.0.1:5000/pause:3.10"


@pytest.mark.parametrize(
    ("nodes", "pods", "problem"),
    [
        (0, 30, "--nodes"),
        (layout.HOLLOW_MAX + 1, 30, "--nodes"),
        (5, 0, "--pods-per-node"),
        (5, 111, "--pods"),
    ],
    ids=["no-nodes", "too-many-nodes", "no-pods", "over-max-pods"],
)
def test_options_out_of_range_are_refused(nodes: int, pods: int, problem: str) -> None:
    got = scale.Options(nodes=nodes, pods_per_node=pods).problem()
    assert got is not None and problem in got
    assert scale.Options(nodes=5).problem() is None


def test_the_table_names_every_component_and_phase() -> None:
    use = {"cpu": 12.5, "rss_max": 300.0}
    kub = {
        "count": 2,
        "cpu_sum": 6.0,
        "rss_sum": 140.0,
        "cpu_mean": 3.0,
        "cpu_max": 4.0,
        "rss_mean": 70.0,
        "rss_max": 80.0,
    }
    host = {"busy": 40.0, "steal": 1.0, "mem_available_min": 20000.0, "load1_max": 2.0}
    phase = {"seconds": 30, "components": dict.fromkeys(scale.COMPONENTS, use), "kubelets": kub, "host": host}
    result = {
        "nodes": 2, "pods_per_node": 30, "date": "2026-12-03 20:00 UTC", "ncpu": 2,
        "loadavg_before": ["1.0", "1.0", "1.0"], "loadavg_after": ["2.0", "1.5", "1.1"],
        "up_seconds": 30.0, "nodes_ready_seconds": 25.0,
        "rollout": {"all_scheduled": 5.0, "half_running": 6.0, "p90_running": 8.0, "all_running": 9.0},
        "per_pod": scale.pod_latencies([]),
        "phases": {"idle": phase, "rollout": phase, "steady": phase},
    }  # fmt: skip
    text = scale.table(result)
    assert "2 hollow nodes x 30 pods = 60 pods" in text and "all Running 9.0 s" in text
    for comp in scale.COMPONENTS:
        assert f"| {comp} | 12.5 | 12.5 | 12.5 | 300 | 300 | 300 |" in text
    assert "| kubelets, sum | 6.0 | 6.0 | 6.0 | 140 | 140 | 140 |" in text
    row = scale.summary_row(result)
    assert row["pods"] == 60 and row["all_running_s"] == 9.0 and row["kubelets_cpu"] == 6.0


# ------------------------------------------------------------ the real thing, opt-in
@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_three_hollow_nodes_with_real_kubelets_run_five_pods_each_and_leave_nothing() -> None:
    if not os.environ.get("CRI_SHIM_K8S_BIN_DIR"):
        pytest.skip("set CRI_SHIM_K8S_BIN_DIR to the Kubernetes binaries to run the scale mode")
    b = layout.Binaries.from_env()
    opts = scale.Options(nodes=3, pods_per_node=5, rest=6)
    problem = scale.environment_problem(b, opts)
    if problem:
        pytest.skip(problem)
    result = scale.run(b, opts)
    print(scale.table(result))
    assert result["left_after_down"] == [] and bringup.check() == []
    assert result["rollout"].get("all_running") is not None, result["rollout"]
    assert result["per_pod"]["pods_per_node"] == {"min": 5, "max": 5}
    assert result["per_pod"]["unscheduled"] == 0
    steady = result["phases"]["steady"]
    assert set(steady["components"]) == set(scale.COMPONENTS)
    assert steady["kubelets"]["count"] == 3
    assert all(c["rss_max"] > 0 for c in steady["components"].values())
