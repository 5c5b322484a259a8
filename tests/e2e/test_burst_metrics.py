"""bench/kubelet_burst.py's reading of a kubelet's /metrics histograms (no kubelet needed)."""

from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys
from types import ModuleType

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def burst() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "kubelet_burst", os.path.join(ROOT, "bench", "kubelet_burst.py")
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


PAGE = """# HELP kubelet_pod_start_duration_seconds [ALPHA] Duration in seconds from kubelet seeing a pod ...
# TYPE kubelet_pod_start_duration_seconds histogram
kubelet_pod_start_duration_seconds_bucket{le="0.5"} 0
kubelet_pod_start_duration_seconds_bucket{le="1"} 2
kubelet_pod_start_duration_seconds_bucket{le="2"} 6
kubelet_pod_start_duration_seconds_bucket{le="+Inf"} 10
kubelet_pod_start_duration_seconds_sum 25.5
kubelet_pod_start_duration_seconds_count 10
kubelet_pleg_relist_duration_seconds_bucket{le="0.005"} 3
kubelet_pleg_relist_duration_seconds_bucket{le="0.01"} 4
kubelet_pleg_relist_duration_seconds_bucket{le="+Inf"} 4
kubelet_pleg_relist_duration_seconds_sum 0.02
kubelet_pleg_relist_duration_seconds_count 4
kubelet_other_seconds_bucket{le="1"} 99
kubelet_runtime_operations_duration_seconds_bucket{operation_type="list",le="1"} 7
"""


def test_histograms_are_read_with_their_buckets_sum_and_count(burst: ModuleType) -> None:
    got = burst.histograms(PAGE)
    assert set(got) == {"kubelet_pod_start_duration_seconds", "kubelet_pleg_relist_duration_seconds"}
    buckets, total, count = got["kubelet_pod_start_duration_seconds"]
    assert buckets == {0.5: 0.0, 1.0: 2.0, 2.0: 6.0, math.inf: 10.0}
    assert (total, count) == (25.5, 10.0)


def test_quantiles_interpolate_within_the_bucket_and_stop_at_the_last_bound(burst: ModuleType) -> None:
    h = burst.histograms(PAGE)["kubelet_pod_start_duration_seconds"]
    assert burst.quantile(h, 0.2) == pytest.approx(1.0)  # the 2nd of 10 is the top of (0.5, 1]
    assert burst.quantile(h, 0.4) == pytest.approx(1.5)  # halfway through (1, 2]
    assert burst.quantile(h, 0.9) == 2.0  # in +Inf: the last finite bound
    assert math.isnan(burst.quantile(({}, 0.0, 0.0), 0.5))


def test_only_the_observations_between_two_readings_count(burst: ModuleType) -> None:
    before = burst.histograms(PAGE)["kubelet_pleg_relist_duration_seconds"]
    later = PAGE.replace('le="0.01"} 4', 'le="0.01"} 9').replace('le="+Inf"} 4', 'le="+Inf"} 10')
    later = later.replace("relist_duration_seconds_count 4", "relist_duration_seconds_count 10")
    after = burst.histograms(later)["kubelet_pleg_relist_duration_seconds"]
    buckets, _total, count = burst.minus(after, before)
    assert buckets == {0.005: 0.0, 0.01: 5.0, math.inf: 6.0} and count == 6.0
    assert burst.quantile((buckets, 0.0, count), 0.5) == pytest.approx(0.005 + 0.005 * 3 / 5)


SPIN = """import sys, time
sys.stdin.readline()
t = time.process_time()
while time.process_time() - t < 0.3:
    pass
print("spun", flush=True)
time.sleep(30)
"""


def test_cpu_use_counts_the_shim_apart(burst: ModuleType) -> None:
    """CPU a process spends inside the window is put on it, the runtime's shim under its own label."""
    with subprocess.Popen(
        [sys.executable, "-c", SPIN], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    ) as child:
        assert child.stdin is not None and child.stdout is not None
        try:
            cpu = burst.CpuUse(child.pid)
            child.stdin.write("go\n")
            child.stdin.flush()
            assert child.stdout.readline() == "spun\n"
            cpu.stop()
        finally:
            child.kill()
    spent = cpu.by_program()
    assert spent["cri-shim"] >= 0.25
    assert "python" not in {name for name, secs in spent.items() if secs >= 0.25}
    assert "CPU-s busy of" in cpu.summary() and "cri-shim 0." in cpu.summary()
