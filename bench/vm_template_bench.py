"""Benchmark of the qemu driver's VM templates: pods booted cold beside pods started from a template.

Two in-process ``RunvBackend``s on the qemu driver share one bridge: ``cold`` (``[qemu]
template = false``: every VM boots its kernel and agent) and ``template`` (the default: the
first VM of a shape makes the template, every later one starts from it). One untimed pod each
first (first-use costs; the template's is the making of the template, printed apart), then
``-n`` rounds of one pod each, alternating, so machine noise falls on both alike. A round is
RunPodSandbox, then CreateContainer + StartContainer of a sleeping busybox; the host memory of
the VM (its cgroup's usage) is read, then the pod is stopped and removed, so that idle guests
(which cost CPU under TCG) do not pile up under later rounds.

It prints p50/p90/max per step for each and the ratio. Figures only: nothing is asserted.
Everything it creates (VMs, cgroups, run directories, the bridge and its rules) is removed
at the end, also on failure or Ctrl-C.

Run as root, with the guest image built (scripts/runv-guest) and the registry of
scripts/testenv/up holding the images:
    .venv/bin/python bench/vm_template_bench.py [-n 20] [--guest-dir DIR] [--no-confine] [--shares 9p]
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
from runv_bench import _container, _Events, _sandbox, network_config, remove_leftovers  # noqa: E402

from backends.runv.backend import RunvBackend  # noqa: E402
from backends.runv.drivers import qemu_virtiofs  # noqa: E402
from backends.runv.drivers.qemu import QemuHypervisor  # noqa: E402
from backends.runv.hypervisor import MIB  # noqa: E402
from cri_api import api_pb2 as pb  # noqa: E402
from shim.cri.container_io import ContainerIO  # noqa: E402

KINDS = ("cold", "template")
STEPS = ("RunPodSandbox", "container start", "memory MiB")


def config(
    tmp: str, tag: str, net: dict[str, Any], args: argparse.Namespace, template: bool
) -> dict[str, Any]:
    qemu: dict[str, Any] = {"cgroup_parent": f"cri-shim-vmtpl-{tag}", "template": template}
    if args.guest_dir:
        qemu["guest_dir"] = args.guest_dir
    if not args.confine:
        qemu["confine"] = False
    if args.shares:
        qemu["shares"] = args.shares
    return {
        "root": f"{tmp}/{tag}-root",
        "run_dir": f"/tmp/rvt-{tag}",  # short: agent socket paths must fit in sun_path
        "agent_timeout": 60.0,
        "network": net,
        "driver": "qemu",
        "qemu": qemu,
        # remove_leftovers reads the cgroup parent here
        "stub": {"cgroup_parent": qemu["cgroup_parent"]},
    }


class Side:
    """One backend of the comparison and its samples."""

    def __init__(self, kind: str, cfg: dict[str, Any]) -> None:
        self.kind = kind
        self.backend = RunvBackend(f"vmtpl-{kind}", cfg)
        self.samples: dict[str, list[float]] = {s: [] for s in STEPS}
        self.followed = ContainerIO(lambda _cid, _info: None)
        self.first = 0.0

    async def start(self) -> None:
        await self.backend.lifecycle.start(_Events())
        t0 = time.perf_counter()
        await self.backend.images.pull_image(pb.ImageSpec(image=BUSYBOX), None, None)
        print(f"{self.kind}: pulled {BUSYBOX} in {time.perf_counter() - t0:.1f} s")

    async def pod(self, name: str, timed: bool) -> None:
        lc = self.backend.lifecycle
        sb = _sandbox(name)
        t0 = time.perf_counter()
        await lc.run_sandbox(sb)
        t1 = time.perf_counter()
        try:
            ct = _container(sb)
            await lc.create_container(ct, sb)
            started = await lc.start_container(ct, sb)
            self.followed.follow(ct.id, started.process, None)
            t2 = time.perf_counter()
            memory = self.backend.hv.usage(self.backend._shared.pods[sb.id].vm)[1]
            if timed:
                self.samples["RunPodSandbox"].append(t1 - t0)
                self.samples["container start"].append(t2 - t1)
                self.samples["memory MiB"].append(memory / MIB)
            else:
                self.first = t1 - t0
            await lc.stop_container(ct, 1)
            await lc.remove_container(ct)
        finally:
            await lc.stop_sandbox(sb)
            await lc.remove_sandbox(sb)

    async def close(self) -> None:
        await self.backend.lifecycle.close()


def report(sides: dict[str, Side], n: int) -> None:
    hv = sides["template"].backend.hv
    accel = hv.accel if isinstance(hv, QemuHypervisor) else "?"
    shares = (
        qemu_virtiofs.choose(hv.shares, hv.virtiofsd, hv.guest_dir) if isinstance(hv, QemuHypervisor) else "?"
    )
    print(
        f"\nqemu driver ({accel}, shares {shares}), {n} pods each, alternating; "
        "seconds (memory: MiB of the VM's cgroup)"
    )
    for step in STEPS:
        for kind in KINDS:
            v = sides[kind].samples[step]
            if not v:
                continue
            print(
                f"  {step:<16} {kind:<9} p50 {pct(v, 0.5):8.2f}   p90 {pct(v, 0.9):8.2f}   "
                f"min {min(v):8.2f}   max {max(v):8.2f}"
            )
    cold, tpl = (sides[k].samples["RunPodSandbox"] for k in KINDS)
    if cold and tpl:
        print(
            f"  RunPodSandbox p50: template {pct(tpl, 0.5):.2f} s vs cold {pct(cold, 0.5):.2f} s "
            f"({pct(cold, 0.5) / pct(tpl, 0.5):.1f}x faster)"
        )
    templates = hv.templates if isinstance(hv, QemuHypervisor) else None
    if templates is not None:
        print(
            f"  first pod of the shape (makes the template): {sides['template'].first:.2f} s, "
            f"cold's first pod {sides['cold'].first:.2f} s; templates made {templates.made}, "
            f"VMs restored {templates.restored}, cold fallbacks {templates.fallbacks}"
        )


async def run(args: argparse.Namespace, cfgs: dict[str, dict[str, Any]]) -> None:
    sides = {kind: Side(kind, cfgs[kind]) for kind in KINDS}
    try:
        for side in sides.values():
            await side.start()
            await side.pod(f"{side.kind}-first", timed=False)
        for i in range(args.iterations):
            order = KINDS if i % 2 == 0 else KINDS[::-1]
            for kind in order:
                await sides[kind].pod(f"{kind}-{i}", timed=True)
            print(
                f"  round {i + 1}/{args.iterations}: "
                + ", ".join(f"{k} {sides[k].samples['RunPodSandbox'][-1]:.2f} s" for k in KINDS),
                flush=True,
            )
        report(sides, args.iterations)
    finally:
        for side in sides.values():
            await side.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", "--iterations", type=int, default=20, help="pods per side (20)")
    ap.add_argument("--guest-dir", default="", help="the qemu driver's guest image (default: the driver's)")
    ap.add_argument(
        "--confine", action=argparse.BooleanOptionalAction, default=True, help="QEMU confined (the default)"
    )
    ap.add_argument(
        "--shares",
        choices=("virtiofs", "9p"),
        default="",
        help="the shares' transport (default: the driver's, virtio-fs when it works)",
    )
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("run as root (namespaces, cgroups, taps, runc)", file=sys.stderr)
        return 2
    run_id = uuid.uuid4().hex[:8]
    tmp = tempfile.mkdtemp(prefix="cri-shim-vmtpl-", dir="/tmp")
    net = network_config(tmp, run_id, f"10.96.{random.randrange(256)}.0/24")
    cfgs = {
        "cold": config(tmp, f"{run_id}c", net, args, template=False),
        "template": config(tmp, f"{run_id}t", net, args, template=True),
    }
    signal.signal(signal.SIGTERM, _interrupt)
    failed = False
    try:
        print(f"run {run_id}: {os.cpu_count()} CPUs, python {sys.version.split()[0]}, bridge {net['bridge']}")
        asyncio.run(run(args, cfgs))
    except KeyboardInterrupt:
        failed = True
        print("interrupted; cleaning up", file=sys.stderr)
    finally:
        remove_leftovers(list(cfgs.values()))
        shutil.rmtree(tmp, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
