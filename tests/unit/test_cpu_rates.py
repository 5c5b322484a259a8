"""usage_nano_cores, computed once in the shim from consecutive samples of every backend."""

from __future__ import annotations

from cri_api import api_pb2 as pb
from shim.stats import CpuRates

S = 1_000_000_000


def sample(cid: str, at: float, used: float, rate: int | None = None) -> pb.ContainerStats:
    st = pb.ContainerStats(attributes=pb.ContainerAttributes(id=cid))
    st.cpu.timestamp = int(at * S)
    st.cpu.usage_core_nano_seconds.value = int(used * S)
    if rate is not None:
        st.cpu.usage_nano_cores.value = rate
    return st


def test_the_rate_is_the_change_since_the_previous_sample() -> None:
    rates = CpuRates()
    first = rates.container(sample("c", 10, 1.0))
    assert not first.cpu.HasField("usage_nano_cores")  # nothing to compare with yet
    assert rates.container(sample("c", 12, 2.0)).cpu.usage_nano_cores.value == S // 2  # half a core
    assert rates.container(sample("d", 12, 5.0)).cpu.HasField("usage_nano_cores") is False  # per object


def test_a_backends_own_rate_is_kept_and_odd_samples_give_none() -> None:
    rates = CpuRates()
    rates.container(sample("c", 10, 1.0))
    assert rates.container(sample("c", 11, 2.0, rate=123)).cpu.usage_nano_cores.value == 123
    assert not rates.container(sample("c", 11, 3.0)).cpu.HasField("usage_nano_cores")  # no time passed
    assert not rates.container(sample("c", 13, 0.5)).cpu.HasField("usage_nano_cores")  # counter went back


def test_pods_and_their_containers_and_forgetting() -> None:
    rates = CpuRates()
    for at, used in ((1, 0.0), (2, 1.0)):
        pod = pb.PodSandboxStats(attributes=pb.PodSandboxAttributes(id="p"))
        pod.linux.cpu.timestamp = at * S
        pod.linux.cpu.usage_core_nano_seconds.value = int(used * S)
        pod.linux.containers.append(sample("c", at, used / 2))
        rates.sandbox(pod)
    assert pod.linux.cpu.usage_nano_cores.value == S
    assert pod.linux.containers[0].cpu.usage_nano_cores.value == S // 2
    rates.retain(container_ids=[], sandbox_ids=["p"])
    assert not rates.container(sample("c", 3, 2.0)).cpu.HasField("usage_nano_cores")  # forgotten
