"""The stats messages, built once in the shim from every backend's samples; usage_nano_cores from
consecutive samples."""

from __future__ import annotations

from backends.contract import ContainerRecord, ContainerUsage, SandboxRecord, SandboxUsage
from backends.contract.usage import Interface, Layer, Sample
from cri_api import api_pb2 as pb
from shim.cri.stats_messages import CpuRates, container_stats, sandbox_stats

S = 1_000_000_000


def record(cid: str, sandbox_id: str = "p") -> ContainerRecord:
    cfg = pb.ContainerConfig(metadata=pb.ContainerMetadata(name=cid), labels={"app": "x"})
    return ContainerRecord(id=cid, sandbox_id=sandbox_id, backend="x", config=cfg, created_at=0, log_path="")


def pod(sid: str = "p") -> SandboxRecord:
    return SandboxRecord(id=sid, handler="", backend="x", config=pb.PodSandboxConfig(), created_at=0)


def usage(at: float, used: float, rate: int | None = None, **kw: int) -> ContainerUsage:
    return ContainerUsage(Sample(timestamp=int(at * S), cpu_ns=int(used * S), **kw), cpu_nano_cores=rate)


def test_the_rate_is_the_change_since_the_previous_sample() -> None:
    rates = CpuRates()
    c, d = record("c"), record("d")
    first = container_stats(c, usage(10, 1.0), rates, 0)
    assert not first.cpu.HasField("usage_nano_cores")  # nothing to compare with yet
    assert container_stats(c, usage(12, 2.0), rates, 0).cpu.usage_nano_cores.value == S // 2  # half a core
    assert not container_stats(d, usage(12, 5.0), rates, 0).cpu.HasField("usage_nano_cores")  # per object


def test_a_backends_own_rate_is_kept_and_odd_samples_give_none() -> None:
    rates = CpuRates()
    c = record("c")
    container_stats(c, usage(10, 1.0), rates, 0)
    assert container_stats(c, usage(11, 2.0, rate=123), rates, 0).cpu.usage_nano_cores.value == 123
    assert not container_stats(c, usage(11, 3.0), rates, 0).cpu.HasField("usage_nano_cores")  # no time passed
    assert not container_stats(c, usage(13, 0.5), rates, 0).cpu.HasField(
        "usage_nano_cores"
    )  # counter went back


def test_a_container_message_carries_what_was_measured() -> None:
    c = record("c")
    u = ContainerUsage(
        Sample(timestamp=5 * S, cpu_ns=S, working_set=10, memory_usage=12, rss=8, memory_limit=100),
        Layer("/var/lib/x", used_bytes=4096, inodes_used=3),
    )
    st = container_stats(c, u, CpuRates(), 0)
    assert (
        st.attributes.id == "c"
        and st.attributes.metadata.name == "c"
        and st.attributes.labels == {"app": "x"}
    )
    assert (st.memory.working_set_bytes.value, st.memory.usage_bytes.value, st.memory.rss_bytes.value) == (
        10,
        12,
        8,
    )
    assert st.memory.available_bytes.value == 90  # under its limit
    assert not st.memory.HasField("page_faults")  # not measured: left out
    assert st.writable_layer.fs_id.mountpoint == "/var/lib/x" and st.writable_layer.used_bytes.value == 4096
    # Not measured at all (exited, or the runtime could not say): times only.
    empty = container_stats(c, None, CpuRates(), 7)
    assert empty.cpu.timestamp == 7 and not empty.cpu.HasField("usage_core_nano_seconds")
    assert not empty.HasField("writable_layer")


def test_pods_their_network_and_containers_and_forgetting() -> None:
    rates = CpuRates()
    p, c = pod(), record("c")
    for at, used in ((1, 0.0), (2, 1.0)):
        eth0 = Interface("eth0", rx_bytes=at, rx_errors=0, tx_bytes=2 * at, tx_errors=0)
        u = SandboxUsage(
            Sample(timestamp=at * S, cpu_ns=int(used * S), pids=3),
            interfaces=(Interface("net1", 0, 0, 0, 0), eth0),
            containers={"c": usage(at, used / 2)},
        )
        st = sandbox_stats(p, u, [c, record("other", sandbox_id="q")], rates, 0)
    assert st.linux.cpu.usage_nano_cores.value == S
    assert [x.attributes.id for x in st.linux.containers] == ["c"]
    assert st.linux.containers[0].cpu.usage_nano_cores.value == S // 2
    assert st.linux.process.process_count.value == 3
    assert [i.name for i in st.linux.network.interfaces] == ["net1", "eth0"]
    assert st.linux.network.default_interface.tx_bytes.value == 4
    rates.retain(container_ids=[], sandbox_ids=["p"])
    assert not container_stats(c, usage(3, 2.0), rates, 0).cpu.HasField("usage_nano_cores")  # forgotten
    assert not sandbox_stats(p, None, [c], rates, 0).HasField("linux")  # a pod the backend did not measure
