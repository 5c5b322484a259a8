"""Benchmark of runv's checkpoints on the qemu driver (issue 43): CRIU in the guest, under TCG here.

One in-process ``RunvBackend`` on the qemu driver with ``criu = true`` (the ``--criu`` guest
image) and VM templates (the default). For pods of 1 and of 3 containers, alternating, ``-n``
rounds each: a pod whose containers count once a second (busybox ``sh``, as the issue's test
counter) runs for 3 s, then

- ``CheckpointPod``: the containers paused together, dumped by CRIU, their writable layers read,
  resumed, the archive written (its size is printed too);
- ``RestorePod``: the archive verified, a new pod (its VM from a template) and its containers
  created, each given its checkpoint (what the shim's RestorePod does, minus the gRPC edge);
- ``StartContainer`` of the restored containers: CRIU's restores, one after another;

and both pods are removed. A pod of 1 is also checkpointed by ``CheckpointContainer`` (the
kubelet's call), timed apart. It prints p50 and max per step and size. Figures only: nothing
is asserted. Everything it creates (VMs, cgroups, run directories, the bridge and its rules) is
removed at the end, also on failure or Ctrl-C.

Run as root, with the CRIU guest image built (``scripts/runv-guest --criu``) and the registry
of scripts/testenv/up holding the images:
    .venv/bin/python bench/checkpoint_bench.py [-n 5] [--guest-dir DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shutil
import signal
import sys
import tempfile
import time
import uuid
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from endpoints import BUSYBOX, _interrupt, pct  # noqa: E402
from runv_bench import _Events, _sandbox, network_config, remove_leftovers  # noqa: E402

from backends import contract  # noqa: E402
from backends.runv.backend import RunvBackend  # noqa: E402
from backends.runv.checkpoint import VmCheckpoints  # noqa: E402
from backends.runv.checkpoint_archive import POD_ARCHIVE  # noqa: E402
from backends.runv.drivers.qemu import QemuHypervisor  # noqa: E402
from cri_api import api_pb2 as pb  # noqa: E402
from shim.cri.container_io import ContainerIO  # noqa: E402

COUNTER = ["sh", "-c", "i=0; while true; do i=$((i+1)); echo $i; sleep 1; done"]
SIZES = (1, 3)
STEPS = ("CheckpointPod", "archive MiB", "RestorePod", "StartContainer (all)", "CheckpointContainer")


def config(tmp: str, tag: str, net: dict[str, Any], guest_dir: str) -> dict[str, Any]:
    qemu: dict[str, Any] = {"cgroup_parent": f"cri-shim-ckpt-{tag}", "criu": True}
    if guest_dir:
        qemu["guest_dir"] = guest_dir
    return {
        "root": f"{tmp}/{tag}-root",
        "run_dir": f"/tmp/rvc-{tag}",  # short: agent socket paths must fit in sun_path
        "agent_timeout": 60.0,
        "network": net,
        "driver": "qemu",
        "qemu": qemu,
        "stub": {"cgroup_parent": qemu["cgroup_parent"]},  # remove_leftovers reads it here
    }


def counter(sb: contract.SandboxRecord, name: str) -> contract.ContainerRecord:
    cfg = pb.ContainerConfig(
        metadata=pb.ContainerMetadata(name=name), image=pb.ImageSpec(image=BUSYBOX), command=COUNTER
    )
    return contract.ContainerRecord(
        id=uuid.uuid4().hex + uuid.uuid4().hex,
        sandbox_id=sb.id,
        backend="runv",
        config=cfg,
        created_at=time.time_ns(),
        log_path="",
    )


class Bench:
    def __init__(self, cfg: dict[str, Any], tmp: str) -> None:
        self.backend = RunvBackend("runv-ckpt", cfg)
        assert isinstance(self.backend.checkpoint, VmCheckpoints)
        self.part = self.backend.checkpoint
        self.tmp = tmp
        self.followed = ContainerIO(lambda _cid, _info: None)
        self.samples: dict[int, dict[str, list[float]]] = {n: {s: [] for s in STEPS} for n in SIZES}

    async def start(self) -> None:
        await self.backend.lifecycle.start(_Events())
        await self.backend.images.pull_image(pb.ImageSpec(image=BUSYBOX), None, None)

    async def pod(self, name: str, n: int) -> tuple[contract.SandboxRecord, list[contract.ContainerRecord]]:
        lc = self.backend.lifecycle
        sb = _sandbox(name)
        await lc.run_sandbox(sb)
        cts = [counter(sb, f"c{i}") for i in range(n)]
        for ct in cts:
            await lc.create_container(ct, sb)
            started = await lc.start_container(ct, sb)
            self.followed.follow(ct.id, started.process, None)
        return sb, cts

    async def gone(self, sb: contract.SandboxRecord, cts: list[contract.ContainerRecord]) -> None:
        lc = self.backend.lifecycle
        for ct in cts:
            await lc.stop_container(ct, 1)
            await lc.remove_container(ct)
        await lc.stop_sandbox(sb)
        await lc.remove_sandbox(sb)

    async def round(self, i: int, n: int, timed: bool) -> None:
        s = self.samples[n]
        sb, cts = await self.pod(f"ckpt{n}-{i}", n)
        out = tempfile.mkdtemp(prefix="out-", dir=self.tmp)
        restored: tuple[contract.SandboxRecord, list[contract.ContainerRecord]] | None = None
        try:
            await asyncio.sleep(3)
            t0 = time.perf_counter()
            await self.part.checkpoint_pod(sb, cts, out, {})
            t1 = time.perf_counter()
            size = os.path.getsize(os.path.join(out, POD_ARCHIVE))
            if n == 1:
                location = os.path.join(out, "container.tar")
                t2 = time.perf_counter()
                await self.part.checkpoint_container(cts[0], location, 0)
                if timed:
                    s["CheckpointContainer"].append(time.perf_counter() - t2)
            await self.gone(sb, cts)
            lc = self.backend.lifecycle
            t3 = time.perf_counter()
            ckpt = await self.part.open_pod_checkpoint(out, {}, [c.config for c in cts])
            sb2 = _sandbox(f"again{n}-{i}")
            await lc.run_sandbox(sb2)
            cts2 = [counter(sb2, c.config.metadata.name) for c in cts]
            restored = (sb2, cts2)
            for ct in cts2:
                await lc.create_container(ct, sb2)
                await self.part.restore_container(ct, sb2, ckpt)
            t4 = time.perf_counter()
            for ct in cts2:
                started = await lc.start_container(ct, sb2)
                self.followed.follow(ct.id, started.process, None)
            t5 = time.perf_counter()
            if timed:
                s["CheckpointPod"].append(t1 - t0)
                s["archive MiB"].append(size / (1 << 20))
                s["RestorePod"].append(t4 - t3)
                s["StartContainer (all)"].append(t5 - t4)
        finally:
            if restored is not None:
                await self.gone(*restored)
            shutil.rmtree(out, ignore_errors=True)

    def report(self, rounds: int) -> None:
        hv = self.backend.hv
        accel = hv.accel if isinstance(hv, QemuHypervisor) else "?"
        print(f"\nrunv qemu ({accel}), CRIU in the guest, {rounds} rounds per pod size; seconds (size: MiB)")
        for n in SIZES:
            for step in STEPS:
                v = self.samples[n][step]
                if v:
                    print(
                        f"  {n} container{'s' if n > 1 else ' '} {step:<22} p50 {pct(v, 0.5):7.2f}   "
                        f"min {min(v):7.2f}   max {max(v):7.2f}"
                    )


async def run(args: argparse.Namespace, cfg: dict[str, Any], tmp: str) -> None:
    bench = Bench(cfg, tmp)
    try:
        await bench.start()
        await bench.round(0, 1, timed=False)  # first use: the template of the shape is made
        for i in range(args.iterations):
            for n in SIZES if i % 2 == 0 else SIZES[::-1]:
                await bench.round(i, n, timed=True)
            print(
                f"  round {i + 1}/{args.iterations}: "
                + ", ".join(
                    f"{n}: pod checkpoint {bench.samples[n]['CheckpointPod'][-1]:.2f} s" for n in SIZES
                ),
                flush=True,
            )
        bench.report(args.iterations)
    finally:
        await bench.backend.lifecycle.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", "--iterations", type=int, default=5, help="rounds per pod size (5)")
    ap.add_argument("--guest-dir", default="", help="the --criu guest image (default: the driver's)")
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("run as root (namespaces, cgroups, taps, runc)", file=sys.stderr)
        return 2
    run_id = uuid.uuid4().hex[:8]
    tmp = tempfile.mkdtemp(prefix="cri-shim-ckpt-", dir="/tmp")
    net = network_config(tmp, run_id, f"10.97.{random.randrange(256)}.0/24")
    cfg = config(tmp, run_id, net, args.guest_dir)
    signal.signal(signal.SIGTERM, _interrupt)
    failed = False
    try:
        print(f"run {run_id}: {os.cpu_count()} CPUs, python {sys.version.split()[0]}, bridge {net['bridge']}")
        asyncio.run(run(args, cfg, tmp))
    except KeyboardInterrupt:
        failed = True
        print("interrupted; cleaning up", file=sys.stderr)
    finally:
        remove_leftovers([cfg])
        shutil.rmtree(tmp, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
