"""Micro-benchmark of the stub driver: ``python -m tests.runv.bench_vm [N]`` (root, runc).

Prints VM boot latency, pod+container start latency, memory per idle VM and
the density the node's capacity allows at the default sizing.
"""

from __future__ import annotations

import asyncio
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from backends.runv.backend import RunvBackend
from backends.runv.hypervisor import MIB
from backends.runv.stub import Cgroup
from tests.runv.helpers import BUSYBOX, Events, MemorySink, container_record, sandbox_record


async def main(n: int) -> None:
    tag = uuid.uuid4().hex[:8]
    with tempfile.TemporaryDirectory() as tmp:
        rootfs = Path(tmp, "rootfs")
        (rootfs / "bin").mkdir(parents=True)
        (rootfs / "etc").mkdir()
        assert BUSYBOX is not None
        Path(rootfs, "bin", "busybox").write_bytes(Path(BUSYBOX).read_bytes())
        Path(rootfs, "bin", "busybox").chmod(0o755)
        Path(rootfs, "bin", "sleep").symlink_to("busybox")
        Path(rootfs, "etc", "passwd").write_text("root:x:0:0:root:/root:/bin/sh\n")
        cfg: dict[str, Any] = {
            "root": f"{tmp}/root",
            "run_dir": f"/tmp/rvb-{tag}",
            "stub": {"cgroup_parent": f"runv-bench-{tag}"},
        }
        backend = RunvBackend("runv", cfg)
        await backend.start(Events())
        backend.images.import_dir("bench/busybox:1", str(rootfs))
        boots: list[float] = []
        starts: list[float] = []
        pods = []
        try:
            for i in range(n):
                sb = sandbox_record(f"b{i}")
                t0 = time.perf_counter()
                await backend.run_sandbox(sb)
                t1 = time.perf_counter()
                ct = container_record(sb, "bench/busybox:1", ["sleep", "3600"])
                await backend.create_container(ct, sb)
                await backend.start_container(ct, sb, MemorySink())
                t2 = time.perf_counter()
                boots.append(t1 - t0)
                starts.append(t2 - t0)
                pods.append(sb)
            await asyncio.sleep(1.0)
            mems = [backend.hv.usage(backend._pods[sb.id].vm)[1] for sb in pods]
            _, total_c, _, total_m = backend.hv.capacity()
            per_vm = statistics.mean(mems)
            print(f"VMs: {n}")
            print(
                f"VM boot latency (stub): p50 {statistics.median(boots) * 1000:.0f} ms, max {max(boots) * 1000:.0f} ms"
            )
            print(f"pod+container start p50: {statistics.median(starts) * 1000:.0f} ms")
            print(
                f"memory per idle VM (cgroup usage, agent + one sleeping container): {per_vm / MIB:.1f} MiB"
            )
            density = min(total_c, total_m // (128 * MIB))
            print(
                f"capacity {total_c} vCPU / {total_m // MIB} MiB -> density at 1 vCPU/128 MiB: {density} pods"
            )
        finally:
            for sb in pods:
                await backend.stop_sandbox(sb)
            await backend.close()
            Cgroup(f"runv-bench-{tag}").remove()
            shutil.rmtree(cfg["run_dir"], ignore_errors=True)


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]) if len(sys.argv) > 1 else 5))
