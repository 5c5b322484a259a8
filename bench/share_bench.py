"""Benchmark of the qemu driver's share transports: 9p beside virtio-fs, in one run.

Two in-process ``RunvBackend``s on the qemu driver share one bridge: ``9p`` (``[qemu] shares
= "9p"``: QEMU's virtio-9p, through the 9p proxy when confined) and ``virtiofs`` (``shares =
"virtiofs"``: virtiofsd). Each runs one pod with a busybox container whose ``/vol`` is a host
directory (a volume: a share of the VM). Then ``-n`` rounds, alternating which transport goes
first, so machine noise falls on both alike; a round is one busybox shell script exec'd in the
container, timing (``/proc/uptime`` in the guest, 10 ms steps) each phase:

- ``write 64 MiB``: ``dd`` of 64 MiB of zeros to ``/vol`` in 1 MiB blocks, ``conv=fsync``;
- ``read 64 MiB``: ``dd`` to /dev/null of a 64 MiB file the host wrote just before the round
  (a file of its own each round: never in the guest's page cache);
- ``create``, ``stat``, ``read``, ``unlink`` of ``--files`` (500) files of 4 KiB in a directory
  of ``/vol``: created by the shell's own ``printf`` (no process per file), stated by one
  ``ls -l``, read by one ``cat``, removed by one ``rm -r``.

It prints p50/min/max per phase per transport, throughputs in MiB/s, small-file figures in
microseconds per file, and virtio-fs's speed-up over 9p (the ratio of the p50s). Figures only:
nothing is asserted. Everything it creates (VMs, cgroups, run directories, the bridge and its
rules, the volumes) is removed at the end, also on failure or Ctrl-C.

Run as root, with the guest image built (scripts/runv-guest, with virtiofs.ko) and the
registry of scripts/testenv/up holding the images:
    .venv/bin/python bench/share_bench.py [-n 5] [--files 500] [--guest-dir DIR] [--no-confine]
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
from backends.runv.drivers.qemu import QemuHypervisor  # noqa: E402
from backends.runv.hypervisor import MIB  # noqa: E402
from cri_api import api_pb2 as pb  # noqa: E402
from shim.cri.container_io import ContainerIO  # noqa: E402

KINDS = ("9p", "virtiofs")
BIG_MIB = 64
BIG = ("write 64 MiB", "read 64 MiB")
SMALL = ("create", "stat", "read", "unlink")

# $1: the host's file to read, $2: how many small files. Prints "<phase> <seconds>" lines.
SCRIPT = r"""
set -e
t() { cut -d' ' -f1 /proc/uptime; }
say() { echo "$1 $(echo "$3 $2" | awk '{printf "%.2f", $1 - $2}')"; }
cd /vol
a=$(t); dd if=/dev/zero of=big bs=1M count=64 conv=fsync 2>/dev/null; b=$(t)
say "write 64 MiB" "$a" "$b"
a=$(t); dd if="$1" of=/dev/null bs=1M 2>/dev/null; b=$(t)
say "read 64 MiB" "$a" "$b"
rm -f big
x=$(head -c 4095 /dev/zero | tr '\0' x)
mkdir s
a=$(t); i=0; while [ "$i" -lt "$2" ]; do printf '%s\n' "$x" > "s/f$i"; i=$((i + 1)); done; b=$(t)
say create "$a" "$b"
a=$(t); ls -l s > /dev/null; b=$(t)
say stat "$a" "$b"
a=$(t); cat s/* > /dev/null; b=$(t)
say read "$a" "$b"
a=$(t); rm -r s; b=$(t)
say unlink "$a" "$b"
"""


def config(tmp: str, tag: str, net: dict[str, Any], args: argparse.Namespace, shares: str) -> dict[str, Any]:
    qemu: dict[str, Any] = {"cgroup_parent": f"cri-shim-share-{tag}", "shares": shares}
    if args.guest_dir:
        qemu["guest_dir"] = args.guest_dir
    if not args.confine:
        qemu["confine"] = False
    return {
        "root": f"{tmp}/{tag}-root",
        "run_dir": f"/tmp/rvs-{tag}",  # short: agent socket paths must fit in sun_path
        "agent_timeout": 300.0,
        "network": net,
        "driver": "qemu",
        "qemu": qemu,
        "stub": {"cgroup_parent": qemu["cgroup_parent"]},  # remove_leftovers reads it here
    }


class Side:
    """One transport: its backend, its pod and container, its volume, its samples."""

    def __init__(self, kind: str, cfg: dict[str, Any], volume: str) -> None:
        self.kind = kind
        self.backend = RunvBackend(f"share-{kind}", cfg)
        self.volume = volume
        self.samples: dict[str, list[float]] = {p: [] for p in (*BIG, *SMALL)}
        self.followed = ContainerIO(lambda _cid, _info: None)
        self.sb: contract.SandboxRecord | None = None
        self.ct: contract.ContainerRecord | None = None

    async def start(self) -> None:
        lc = self.backend.lifecycle
        await lc.start(_Events())
        await self.backend.images.pull_image(pb.ImageSpec(image=BUSYBOX), None, None)
        self.sb = _sandbox(f"share-{self.kind}")
        t0 = time.perf_counter()
        await lc.run_sandbox(self.sb)
        cfg = pb.ContainerConfig(
            metadata=pb.ContainerMetadata(name="app"),
            image=pb.ImageSpec(image=BUSYBOX),
            command=["sleep", "36000"],
            mounts=[pb.Mount(container_path="/vol", host_path=self.volume)],
        )
        self.ct = contract.ContainerRecord(
            id=uuid.uuid4().hex + uuid.uuid4().hex,
            sandbox_id=self.sb.id,
            backend="runv",
            config=cfg,
            created_at=time.time_ns(),
            log_path="",
        )
        await lc.create_container(self.ct, self.sb)
        started = await lc.start_container(self.ct, self.sb)
        self.followed.follow(self.ct.id, started.process, None)
        print(f"{self.kind}: pod and container up in {time.perf_counter() - t0:.1f} s", flush=True)

    async def round(self, i: int, files: int, data: bytes) -> None:
        assert self.ct is not None
        name = f"host{i}"
        with open(os.path.join(self.volume, name), "wb") as fh:
            fh.write(data)
        res = await self.backend.exec.exec_sync(
            self.ct, ["sh", "-c", SCRIPT, "sh", f"/vol/{name}", str(files)]
        )
        os.unlink(os.path.join(self.volume, name))
        if res.exit_code != 0:
            raise RuntimeError(
                f"{self.kind}: the script failed ({res.exit_code}): {res.stderr.decode()[-500:]}"
            )
        for line in res.stdout.decode().splitlines():
            phase, _, seconds = line.rpartition(" ")
            if phase in self.samples:
                self.samples[phase].append(float(seconds))

    async def close(self) -> None:
        lc = self.backend.lifecycle
        try:
            if self.sb is not None:
                await lc.stop_sandbox(self.sb)
                await lc.remove_sandbox(self.sb)
        finally:
            await lc.close()


def report(sides: dict[str, Side], n: int, files: int) -> None:
    hv = sides["virtiofs"].backend.hv
    accel = hv.accel if isinstance(hv, QemuHypervisor) else "?"
    print(f"\nqemu driver ({accel}), {n} rounds, alternating; guest-side times of a volume's files")
    print(f"  {'phase':<14} {'transport':<9} {'p50 s':>8} {'min s':>8} {'max s':>8}   figure (p50)")
    for phase in (*BIG, *SMALL):
        for kind in KINDS:
            v = sides[kind].samples[phase]
            if not v:
                continue
            p50 = pct(v, 0.5)
            if phase in BIG:
                figure = f"{BIG_MIB / p50:8.1f} MiB/s" if p50 > 0 else "       - MiB/s"
            else:
                figure = f"{p50 / files * 1e6:8.0f} us/file"
            label = phase if phase in BIG else f"{phase} x{files}"
            print(f"  {label:<14} {kind:<9} {p50:8.2f} {min(v):8.2f} {max(v):8.2f}   {figure}")
    print("  virtio-fs vs 9p (p50 time of 9p / p50 time of virtio-fs; >1: virtio-fs faster):")
    for phase in (*BIG, *SMALL):
        p9, vf = (sides[k].samples[phase] for k in KINDS)
        if p9 and vf and pct(vf, 0.5) > 0:
            print(f"    {phase:<14} {pct(p9, 0.5) / pct(vf, 0.5):6.2f}x")


async def run(args: argparse.Namespace, cfgs: dict[str, dict[str, Any]], volumes: dict[str, str]) -> None:
    sides = {kind: Side(kind, cfgs[kind], volumes[kind]) for kind in KINDS}
    data = os.urandom(BIG_MIB * MIB)
    try:
        for side in sides.values():
            await side.start()
        for i in range(args.iterations):
            order = KINDS if i % 2 == 0 else KINDS[::-1]
            for kind in order:
                await sides[kind].round(i, args.files, data)
            print(
                f"  round {i + 1}/{args.iterations}: "
                + ", ".join(
                    f"{k} write {sides[k].samples[BIG[0]][-1]:.2f} s read {sides[k].samples[BIG[1]][-1]:.2f} s "
                    f"create {sides[k].samples['create'][-1]:.2f} s"
                    for k in KINDS
                ),
                flush=True,
            )
        report(sides, args.iterations, args.files)
    finally:
        for side in sides.values():
            await side.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", "--iterations", type=int, default=5, help="rounds per transport (5)")
    ap.add_argument("--files", type=int, default=500, help="small files per round (500)")
    ap.add_argument("--guest-dir", default="", help="the qemu driver's guest image (default: the driver's)")
    ap.add_argument(
        "--confine", action=argparse.BooleanOptionalAction, default=True, help="QEMU confined (the default)"
    )
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("run as root (namespaces, cgroups, taps, runc)", file=sys.stderr)
        return 2
    run_id = uuid.uuid4().hex[:8]
    tmp = tempfile.mkdtemp(prefix="cri-shim-share-", dir="/var/tmp")  # the volumes: on disk, not tmpfs
    net = network_config(tmp, run_id, f"10.97.{random.randrange(256)}.0/24")
    cfgs = {kind: config(tmp, f"{run_id}{kind[0]}", net, args, kind) for kind in KINDS}
    volumes = {kind: os.path.join(tmp, f"vol-{kind}") for kind in KINDS}
    for v in volumes.values():
        os.makedirs(v)
    signal.signal(signal.SIGTERM, _interrupt)
    failed = False
    try:
        print(f"run {run_id}: {os.cpu_count()} CPUs, python {sys.version.split()[0]}, volumes under {tmp}")
        asyncio.run(run(args, cfgs, volumes))
    except KeyboardInterrupt:
        failed = True
        print("interrupted; cleaning up", file=sys.stderr)
    finally:
        remove_leftovers(list(cfgs.values()))
        shutil.rmtree(tmp, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
