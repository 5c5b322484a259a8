"""Benchmark of image pulls: runv's OCI image store vs containerd's CRI plugin vs the Docker engine.

The images, made here and pushed to the test registry (127.0.0.1:5000) unless it has them
already (their content is deterministic: a rerun pushes nothing):
- ``pullbench/app:v2``: 5 gzip layers, about 200 MB unpacked (30, 50, 15, 65 and 40 MB of
  files: many small ones and a few large, text-like and compressible about 2.5x, with some
  incompressible files among them), no shell: it is pulled, never run;
- ``pullbench/base:v2``: the first two of those layers (the "base" of the warm case);
- ``pullbench/small-0..9:v2``: ten distinct images of two layers (8 + 12 MB unpacked).

Measured, in turns within each round so that a shared machine's load falls on all alike:
- cold: ``app`` with nothing of it present: runv's ``ImageStore.pull`` on a fresh root (in
  process, as the backend calls it), containerd-CRI's PullImage, the engine's pull (docker
  SDK); after each, the image is removed and the runtime's content store checked empty of it
  (containerd's blobs and snapshots: ``ctr content ls`` / ``snapshots ls``);
- warm-base: ``base`` pulled first (untimed), then ``app`` timed: three layers to fetch;
- ten at once: the ten small images pulled concurrently (runv: one store, ten ``pull``
  coroutines; containerd and the engine: ten threads each calling its pull).

It prints p50 and max of ``-n`` rounds (3) per case and runtime, and the ratios of the p50s
runv / containerd and runv / docker. Figures only: nothing is asserted. Everything it pulls
is removed at the end, also on failure or Ctrl-C (the registry keeps the images).

Run as root with the registry of scripts/testenv/up and containerd-up:
    .venv/bin/python bench/pull_bench.py [-n 3] [--only runv,containerd,docker] [--no-many]
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import gzip
import hashlib
import io
import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

import docker

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from backends.oci.settings import PullSettings  # noqa: E402
from backends.runv.images.store import ImageStore  # noqa: E402
from bench.endpoints import CONTAINERD_SOCK, REGISTRY, Cri, _interrupt, pct, wait_quiet  # noqa: E402
from cri_api import api_pb2 as pb  # noqa: E402

MIB = 1024 * 1024
MANIFEST_V2 = "application/vnd.docker.distribution.manifest.v2+json"
CONFIG_V2 = "application/vnd.docker.container.image.v1+json"
LAYER_GZIP = "application/vnd.docker.image.rootfs.diff.tar.gzip"
# (seed, unpacked size): the app's five layers, the first two also the base image's.
APP_LAYERS = [(1, 30 * MIB), (2, 50 * MIB), (3, 15 * MIB), (4, 65 * MIB), (5, 40 * MIB)]
SMALL = 10
APP = f"{REGISTRY}/pullbench/app:v2"
BASE = f"{REGISTRY}/pullbench/base:v2"
SMALLS = [f"{REGISTRY}/pullbench/small-{i}:v2" for i in range(SMALL)]
ALL = [APP, BASE, *SMALLS]


# ---------------------------------------------------------------- the images


def _pool() -> bytes:
    """18 MB of text-like bytes that files take windows of: words of letters at English-like
    frequencies, the words at Zipf-like frequencies (gzip makes about 2.8x of it)."""
    r = random.Random(0)
    letters = b"etaoinshrdlcumwfgypbvkjxqz"
    freq = [12, 9, 8, 8, 7, 7, 6, 6, 6, 4, 4, 3, 3, 2, 2, 2, 2, 2, 1, 1, 1, 1, 1, 1, 1, 1]
    words = [bytes(r.choices(letters, weights=freq, k=r.randint(2, 10))) for _ in range(3000)]
    return b" ".join(r.choices(words, weights=[1 / (i + 1) for i in range(len(words))], k=2_500_000))


def layer_tar(seed: int, size: int, pool: bytes) -> bytes:
    """A layer of about ``size`` bytes of files under pullbench/<seed>/."""
    r = random.Random(seed)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:

        def add(name: str, data: bytes | None, mode: int) -> None:
            info = tarfile.TarInfo(name)
            info.mode, info.mtime = mode, 1_700_000_000
            if data is None:
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
            else:
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))

        add("pullbench", None, 0o755)
        top = f"pullbench/layer-{seed}"
        add(top, None, 0o755)
        written = 0
        n = 0
        while written < size:
            if n % 64 == 0:
                add(f"{top}/d{n // 64}", None, 0o755)
            length = r.randint(1 * MIB, 6 * MIB) if r.random() < 0.02 else r.randint(200, 48 * 1024)
            if r.random() < 0.08:
                data = r.randbytes(length)  # already compressed (images, archives)
            else:
                start = r.randrange(len(pool) - length)
                data = pool[start : start + length]
            add(f"{top}/d{n // 64}/f{n}", data, 0o755 if n % 7 == 0 else 0o644)
            written += length
            n += 1
    return buf.getvalue()


def _req(method: str, url: str, body: bytes | None = None, headers: dict[str, str] | None = None) -> Any:
    return urllib.request.urlopen(
        urllib.request.Request(url, data=body, method=method, headers=headers or {}), timeout=300
    )


def _has(path: str, accept: str = "") -> bool:
    try:
        _req("HEAD", f"http://{REGISTRY}/v2/{path}", headers={"Accept": accept} if accept else {}).close()
        return True
    except urllib.error.HTTPError:
        return False


def _push_blob(repo: str, data: bytes) -> str:
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    if not _has(f"{repo}/blobs/{digest}"):
        up = _req("POST", f"http://{REGISTRY}/v2/{repo}/blobs/uploads/", b"")
        location = up.headers["Location"]
        up.close()
        if location.startswith("/"):
            location = f"http://{REGISTRY}{location}"
        sep = "&" if "?" in location else "?"
        _req(
            "PUT", f"{location}{sep}digest={digest}", data, {"Content-Type": "application/octet-stream"}
        ).close()
    return digest


def push_image(ref: str, layers: list[tuple[int, int]], pool: bytes) -> int:
    """Build and push ``ref`` unless the registry has it; its compressed size."""
    repo, tag = ref.removeprefix(f"{REGISTRY}/").split(":")
    if _has(f"{repo}/manifests/{tag}", MANIFEST_V2):
        manifest = json.load(
            _req("GET", f"http://{REGISTRY}/v2/{repo}/manifests/{tag}", None, {"Accept": MANIFEST_V2})
        )
        return sum(int(layer["size"]) for layer in manifest["layers"])
    entries, diff_ids = [], []
    for seed, size in layers:
        raw = layer_tar(seed, size, pool)
        blob = gzip.compress(raw, 6, mtime=0)
        diff_ids.append("sha256:" + hashlib.sha256(raw).hexdigest())
        entries.append({"mediaType": LAYER_GZIP, "size": len(blob), "digest": _push_blob(repo, blob)})
    config = json.dumps(
        {
            "architecture": "amd64",
            "os": "linux",
            "config": {"Cmd": ["/true"], "Labels": {"io.cri-shim.bench": ref}},
            "rootfs": {"type": "layers", "diff_ids": diff_ids},
        },
        sort_keys=True,
    ).encode()
    manifest_doc = {
        "schemaVersion": 2,
        "mediaType": MANIFEST_V2,
        "config": {"mediaType": CONFIG_V2, "size": len(config), "digest": _push_blob(repo, config)},
        "layers": entries,
    }
    body = json.dumps(manifest_doc).encode()
    _req("PUT", f"http://{REGISTRY}/v2/{repo}/manifests/{tag}", body, {"Content-Type": MANIFEST_V2}).close()
    return sum(int(e["size"]) for e in entries)


def make_images() -> None:
    t0 = time.monotonic()
    pool = _pool()
    app = push_image(APP, APP_LAYERS, pool)
    push_image(BASE, APP_LAYERS[:2], pool)
    small = sum(
        push_image(ref, [(100 + 2 * i, 8 * MIB), (101 + 2 * i, 12 * MIB)], pool)
        for i, ref in enumerate(SMALLS)
    )
    unpacked = sum(s for _, s in APP_LAYERS) / MIB
    print(
        f"images ready in {time.monotonic() - t0:.1f} s: app {unpacked:.0f} MiB unpacked, "
        f"{app / MIB:.0f} MiB compressed; {SMALL} small images, {small / MIB:.0f} MiB compressed in all"
    )


# ---------------------------------------------------------------- the runtimes


class Runv:
    """runv's ImageStore in process, a fresh root for each case."""

    name = "runv"

    def __init__(self, tmp: str) -> None:
        self.tmp = tmp
        self.root = ""

    def fresh(self) -> None:
        self.root = tempfile.mkdtemp(prefix="runv-images-", dir=self.tmp)
        self.store = ImageStore(self.root, PullSettings())

    def pull(self, refs: list[str]) -> None:
        async def many() -> None:
            await asyncio.gather(*(self.store.pull(ref) for ref in refs))

        asyncio.run(many())

    def remove_all(self) -> None:
        if self.root:
            shutil.rmtree(self.root, ignore_errors=True)
            self.root = ""


class Containerd:
    name = "containerd"

    def __init__(self, sock: str, tmp: str) -> None:
        self.sock = sock
        self.cri = Cri("containerd", sock, "pullbench", tmp)

    def fresh(self) -> None:
        pass

    def pull(self, refs: list[str]) -> None:
        def one(ref: str) -> None:
            self.cri.im.PullImage(pb.PullImageRequest(image=pb.ImageSpec(image=ref)), timeout=600)

        _at_once(one, refs)

    def _ctr(self, *args: str) -> str:
        cmd = ["ctr", "-a", self.sock, "-n", "k8s.io", *args]
        return subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=120).stdout

    def remove_all(self) -> None:
        for ref in ALL:  # RemoveImage of an absent image answers OK
            self.cri.im.RemoveImage(pb.RemoveImageRequest(image=pb.ImageSpec(image=ref)), timeout=120)
        # RemoveImage collects the image's content at once; check it, so that cold is cold.
        ours = [
            line.split()[0]
            for line in self._ctr("content", "ls").splitlines()[1:]
            if "distribution.source." in line and "=pullbench/" in line
        ]
        if ours:
            print(f"  containerd kept {len(ours)} blobs of ours: removing them", file=sys.stderr)
            self._ctr("content", "rm", *ours)

    def close(self) -> None:
        self.cri.close()


class Docker:
    name = "docker"

    def __init__(self) -> None:
        self.client = docker.DockerClient(base_url="unix:///var/run/docker.sock", timeout=600)

    def fresh(self) -> None:
        pass

    def pull(self, refs: list[str]) -> None:
        def one(ref: str) -> None:
            repo, tag = ref.rsplit(":", 1)
            self.client.images.pull(repo, tag=tag)

        _at_once(one, refs)

    def remove_all(self) -> None:
        for ref in ALL:
            try:
                self.client.images.remove(ref, force=True)
            except docker.errors.ImageNotFound:
                pass

    def close(self) -> None:
        self.client.close()


def _at_once(fn: Callable[[str], None], refs: list[str]) -> None:
    if len(refs) == 1:
        fn(refs[0])
        return
    with concurrent.futures.ThreadPoolExecutor(len(refs)) as pool:
        for f in [pool.submit(fn, r) for r in refs]:
            f.result()


# ---------------------------------------------------------------- the rounds

Runtime = Runv | Containerd | Docker


def _pid_listening(sock: str) -> int:
    """The PID of the process listening on the unix socket ``sock`` (0: none found)."""
    with open("/proc/net/unix") as f:
        inodes = {line.split()[6] for line in f.read().splitlines()[1:] if line.endswith(" " + sock)}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
            if any(os.readlink(f"/proc/{pid}/fd/{fd}")[8:-1] in inodes for fd in fds):
                return int(pid)
        except OSError:
            pass
    return 0


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process, its threads and its children it waited for (the
    engine extracts layers in a child) so far; this process's for ``pid`` 0."""
    if pid == 0:
        t = os.times()
        return t.user + t.system
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return sum(int(x) for x in fields[11:15]) / os.sysconf("SC_CLK_TCK")


def one_case(rt: Runtime, case: str, pid: int, quiet: float) -> tuple[float, float, float]:
    """One timed pull of ``case``: (wall ms, the runtime's CPU ms, the CPUs' busy share
    before it); everything removed after."""
    rt.fresh()
    try:
        if case == "warm-base":
            rt.pull([BASE])
        refs = SMALLS if case == "ten at once" else [APP]
        busy = wait_quiet(quiet, 0.25, window=1.0)[1] if quiet else math.nan
        c0, t0 = cpu_seconds(pid), time.perf_counter()
        rt.pull(refs)
        return (time.perf_counter() - t0) * 1000, (cpu_seconds(pid) - c0) * 1000, busy
    finally:
        rt.remove_all()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", "--rounds", type=int, default=3, help="rounds of each case (3)")
    ap.add_argument("--only", default="runv,containerd,docker", help="runtimes, comma-separated")
    ap.add_argument("--cases", default="cold,warm-base,ten at once", help="cases, comma-separated")
    ap.add_argument("--containerd", default=CONTAINERD_SOCK, help="containerd CRI socket path")
    ap.add_argument(
        "--quiet",
        type=float,
        default=20,
        help="seconds to wait at most for idle CPUs before a pull (20; 0: no wait)",
    )
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, _interrupt)
    wanted = args.only.split(",")
    cases = args.cases.split(",")
    tmp = tempfile.mkdtemp(prefix="pull-bench-", dir="/var/tmp")
    runtimes: list[Runtime] = []
    pids: dict[str, int] = {"runv": 0}
    try:
        make_images()
        if "runv" in wanted:
            runtimes.append(Runv(tmp))
        if "containerd" in wanted:
            ctrd = Containerd(args.containerd, tmp)
            if ctrd.cri.answers():
                runtimes.append(ctrd)
                pids["containerd"] = _pid_listening(args.containerd)
            else:
                print(f"containerd: nothing answers on {args.containerd}; skipped", file=sys.stderr)
        if "docker" in wanted:
            runtimes.append(Docker())
            pids["docker"] = _pid_listening("/var/run/docker.sock") or _pid_listening("/run/docker.sock")
        for rt in runtimes:  # a leftover of an interrupted run would make cold warm
            rt.remove_all()
        wall: dict[tuple[str, str], list[float]] = {}
        cpu: dict[tuple[str, str], list[float]] = {}
        for r in range(args.rounds):
            for case in cases:
                order = runtimes[r % len(runtimes) :] + runtimes[: r % len(runtimes)]
                for rt in order:
                    ms, cpu_ms, busy = one_case(rt, case, pids.get(rt.name, -1), args.quiet)
                    wall.setdefault((case, rt.name), []).append(ms)
                    cpu.setdefault((case, rt.name), []).append(cpu_ms)
                    print(
                        f"  round {r + 1} {case:<12} {rt.name:<11} {ms:7.0f} ms  CPU {cpu_ms:6.0f} ms"
                        f"  (CPUs {busy:.0%} busy before)",
                        flush=True,
                    )
        for title, table in (("wall time", wall), ("CPU time of the runtime's process", cpu)):
            print(f"\n{title}, ms (p50 / max of {args.rounds})")
            for case in cases:
                row = {rt.name: table.get((case, rt.name), []) for rt in runtimes}
                cells = "   ".join(f"{n} {pct(v, 0.5):6.0f} / {max(v):6.0f}" for n, v in row.items() if v)
                ratios = "   ".join(
                    f"runv/{n} {pct(row['runv'], 0.5) / pct(v, 0.5):.2f}x"
                    for n, v in row.items()
                    if v and n != "runv" and row.get("runv")
                )
                print(f"  {case:<12} {cells}   {ratios}")
    except KeyboardInterrupt:
        print("interrupted; cleaning up", file=sys.stderr)
        return 1
    finally:
        for rt in runtimes:
            rt.remove_all()
            if not isinstance(rt, Runv):
                rt.close()
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
