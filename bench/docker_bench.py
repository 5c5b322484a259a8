"""Side-by-side benchmark: cri-shim (docker backend) vs the raw engine vs containerd-CRI.

Runs the same pod + container lifecycle N times through
- cri-shim with the docker backend, started here as a child process on a
  temporary socket, state directory and config;
- the raw Docker Engine through the docker SDK, doing the equivalent work:
  pause container create+start on the engine's network, an app container
  created in the pause container's network and IPC namespaces, start,
  inspect (as the status calls), list, stop, remove, then stop+remove pause;
- containerd's CRI plugin, when its socket answers (scripts/testenv/containerd-up);
- with --cri-dockerd SOCK, cri-dockerd on the same engine (the Docker-engine peer:
  bench/README says how to run it on this machine).
The runtimes take turns inside each iteration, so machine noise (this machine
is shared) falls on all of them alike. Then ListContainerStats is measured with
100 running containers through each CRI endpoint.

It prints p50/p90 per operation and the ratios cri-shim/raw engine,
cri-shim/containerd and cri-shim/cri-dockerd. Figures only: nothing is asserted. Everything it creates
is removed at the end, also on failure or Ctrl-C. Last, ListImages and ImageFsInfo
are timed in turns on the CRI endpoints with about 100 images in each (distinct
images made in the test registry and pulled through CRI, removed after).

Run as root (the engine's and containerd's sockets), with the registry of
scripts/testenv/up holding the images:
    .venv/bin/python bench/docker_bench.py [-n 20] [--stats-containers 100]
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import shutil
import signal
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from typing import Any

import grpc

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from cri_api import api_pb2 as pb  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from endpoints import (  # noqa: E402
    CONTAINERD_SOCK,
    OPS,
    RAW_WORK,
    Cri,
    Raw,
    Samples,
    Shim,
    _interrupt,
    answering,
    clock,
    fill_images,
    image_count,
    pct,
    registry_images,
    remove_bench_images,
)

# ---------------------------------------------------------------- report


def table(
    title: str, cols: list[tuple[str, Samples]], ops: list[str], ratios: list[tuple[str, int, int]]
) -> None:
    print(f"\n{title}")
    head = f"{'operation':<18}"
    for name, _ in cols:
        head += f" | {name + ' p50':>14} {'p90':>8}"
    for label, _, _ in ratios:
        head += f" | {label:>11}"
    print(head)
    print("-" * len(head))
    for op in ops:
        line = f"{op:<18}"
        for _, s in cols:
            v = s.get(op, [])
            line += f" | {pct(v, 0.5):14.2f} {pct(v, 0.9):8.2f}"
        for _, a, b in ratios:
            x, y = pct(cols[a][1].get(op, []), 0.5), pct(cols[b][1].get(op, []), 0.5)
            line += f" | {x / y:10.2f}x" if y and not math.isnan(x + y) else f" | {'-':>11}"
        print(line)


def timed_calls(call: Callable[[], Any], n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        call()
        out.append((time.perf_counter() - t0) * 1000)
    return out


# ---------------------------------------------------------------- the images part


def images_part(cris: list[Cri], target: int, samples: int) -> None:
    """ListImages and ImageFsInfo on every endpoint in turns, each holding about ``target`` images."""
    refs = registry_images(target)
    counts = {}
    for c in cris:
        t0 = time.perf_counter()
        pulled = fill_images(c, refs, target)
        counts[c.name] = image_count(c)
        print(
            f"{c.name}: pulled {len(pulled)} images in {time.perf_counter() - t0:.1f} s; {counts[c.name]} listed"
        )
    res: dict[str, Samples] = {c.name: {} for c in cris}
    list_req, fs_req, version_req = pb.ListImagesRequest(), pb.ImageFsInfoRequest(), pb.VersionRequest()
    for c in cris:  # first calls, untimed
        c.im.ListImages(list_req, timeout=60)
        c.im.ImageFsInfo(fs_req, timeout=60)
    for n in range(samples):
        # Which endpoint goes first alternates: a call right after the other's ListImages
        # (milliseconds of its CPU on these two cores) is slower than one after a light call.
        turn = cris if n % 2 == 0 else cris[::-1]
        for c in turn:
            with clock(res[c.name], "ListImages"):
                c.im.ListImages(list_req, timeout=60)
        for c in turn:
            with clock(res[c.name], "ImageFsInfo"):
                c.im.ImageFsInfo(fs_req, timeout=60)
        for c in turn:  # the floor of one call on each endpoint, for comparison
            with clock(res[c.name], "Version"):
                c.rt.Version(version_req, timeout=60)
    print(
        f"\nImage calls, ms (n={samples} each, in turns; images listed: "
        + ", ".join(f"{k} {v}" for k, v in counts.items())
        + ")"
    )
    head = f"{'operation':<12}" + "".join(f" | {c.name + ' p50':>16} {'p99':>8}" for c in cris)
    head += "".join(f" | {'/' + c.name:>10}" for c in cris[1:])
    print(head)
    print("-" * len(head))
    for op in ("ListImages", "ImageFsInfo", "Version"):
        line = f"{op:<12}"
        for c in cris:
            v = res[c.name][op]
            line += f" | {pct(v, 0.5):16.2f} {pct(v, 0.99):8.2f}"
        for c in cris[1:]:
            line += f" | {pct(res[cris[0].name][op], 0.5) / pct(res[c.name][op], 0.5):9.2f}x"
        print(line)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", "--iterations", type=int, default=20, help="lifecycles per runtime (20)")
    ap.add_argument(
        "--status-repeat", type=int, default=5, help="status/list calls per lifecycle iteration (5)"
    )
    ap.add_argument("--stats-containers", type=int, default=100, help="running containers for stats (100)")
    ap.add_argument("--per-pod", type=int, default=10, help="containers per pod for the stats part (10)")
    ap.add_argument("--stats-samples", type=int, default=20, help="ListContainerStats calls timed (20)")
    ap.add_argument("--containerd", default=CONTAINERD_SOCK, help="containerd CRI socket path")
    ap.add_argument(
        "--cri-dockerd",
        default="",
        metavar="SOCK",
        help="also cri-dockerd's CRI socket path, on the same engine (bench/README: how to run it here)",
    )
    ap.add_argument("--keep-tmp", action="store_true", help="keep the temp dir (shim log) for inspection")
    ap.add_argument(
        "--warm",
        type=int,
        default=0,
        metavar="SIZE",
        help="also time RunPodSandbox of host-network pods on a second cri-shim with a pool of SIZE "
        "warm pause containers, beside the first (cold) and containerd (0: skip)",
    )
    ap.add_argument(
        "--images",
        type=int,
        default=100,
        help="images each CRI endpoint holds for the image calls (100; 0: skip)",
    )
    ap.add_argument("--image-samples", type=int, default=200, help="ListImages/ImageFsInfo calls timed (200)")
    ap.add_argument("--images-only", action="store_true", help="only the image calls")
    ap.add_argument(
        "--transport", choices=["grpcio", "native"], help="cri-shim serve --transport (its default)"
    )
    args = ap.parse_args()

    run_id = uuid.uuid4().hex[:8]
    tmp = tempfile.mkdtemp(prefix="cri-shim-bench-", dir="/tmp")
    logs = f"{tmp}/pod-logs"
    os.makedirs(logs)
    shim: Shim | None = None
    pooled: Shim | None = None
    cris: list[Cri] = []
    raw: Raw | None = None
    imaged: list[Cri] = []  # endpoints the images part pulled into
    failed = False
    # SIGTERM cleans up like Ctrl-C does.
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        shim = Shim(tmp, run_id, transport=args.transport or "")
        sh = Cri("cri-shim", shim.sock, run_id, logs)
        cris.append(sh)
        try:
            sh.wait_ready(60)
        except grpc.RpcError:
            print(f"cri-shim did not answer on {shim.sock}; its log: {tmp}/cri-shim.log", file=sys.stderr)
            args.keep_tmp = True
            raise
        raw = Raw(run_id)
        ctrd: Cri | None = Cri("containerd", args.containerd, run_id, logs)
        assert ctrd is not None
        if ctrd.answers():
            cris.append(ctrd)
            ver = ctrd.rt.Version(pb.VersionRequest(), timeout=5)
            ctrd_desc = f"{ver.runtime_name} {ver.runtime_version}"
        else:
            print(
                f"containerd-CRI: skipped, nothing answers on unix://{args.containerd} "
                "(start one with: sudo scripts/testenv/containerd-up)"
            )
            ctrd.close()
            ctrd = None
            ctrd_desc = "skipped"
        crid: Cri | None = None
        if args.cri_dockerd:
            crid = answering("cri-dockerd", args.cri_dockerd, run_id, logs)
            if crid is None:
                return 1
            cris.append(crid)
            ver = crid.rt.Version(pb.VersionRequest(), timeout=5)
            ctrd_desc += f", cri-dockerd {ver.runtime_version}"
        eng = raw.api.version()
        print(
            f"run {run_id}: {args.iterations} lifecycles per runtime, {os.cpu_count()} CPUs, "
            f"python {sys.version.split()[0]}, engine {eng.get('Version')}, containerd-CRI {ctrd_desc}"
        )
        if args.images_only:
            imaged = list(cris)
            images_part(imaged, args.images, args.image_samples)
            return 0

        # Images in place, and one untimed lifecycle each (first-use costs).
        raw.pull()
        sh.pull()
        if ctrd:
            ctrd.pull()
        warm: Samples = {}
        sh.lifecycle(warm, 1)
        raw.lifecycle(warm, 1)
        if ctrd:
            ctrd.lifecycle(warm, 1)
        if crid:
            crid.pull()
            crid.lifecycle(warm, 1)

        res_shim: Samples = {}
        res_raw: Samples = {}
        res_ctrd: Samples = {}
        res_crid: Samples = {}
        for _ in range(args.iterations):
            # The pause image of cri-shim is the engine's too: raw.pull covers both.
            raw.pull()
            sh.pull()
            sh.lifecycle(res_shim, args.status_repeat)
            raw.pull()
            raw.lifecycle(res_raw, args.status_repeat)
            if ctrd:
                ctrd.lifecycle(res_ctrd, args.status_repeat)
            if crid:
                crid.pull()
                crid.lifecycle(res_crid, args.status_repeat)

        cols: list[tuple[str, Samples]] = [("cri-shim", res_shim), ("raw engine", res_raw)]
        ratios = [("shim/raw", 0, 1)]
        if ctrd:
            cols.append(("containerd", res_ctrd))
            ratios.append(("shim/ctrd", 0, 2))
        if crid:
            cols.append(("cri-dockerd", res_crid))
            ratios.append(("shim/crid", 0, len(cols) - 1))
        n_status = args.iterations * args.status_repeat
        table(
            f"Pod + container lifecycle, ms (n={args.iterations}; status/list calls n={n_status})",
            cols,
            OPS,
            ratios,
        )
        print("raw engine work per operation: " + "; ".join(f"{k}: {v}" for k, v in RAW_WORK.items()))

        # ListContainerStats with many running containers.
        stats_rows: list[tuple[str, str, list[float]]] = []
        for c in cris:
            raw.pull()
            c.pull()
            t0 = time.perf_counter()
            c.start_many(args.stats_containers, args.per_pod)
            made = time.perf_counter() - t0
            running = c.running_containers()
            req = pb.ListContainerStatsRequest()
            c.rt.ListContainerStats(req, timeout=60)  # first call primes any caches
            call = functools.partial(c.rt.ListContainerStats, req, timeout=60)
            took = timed_calls(call, args.stats_samples)
            print(
                f"{c.name}: started {args.stats_containers} containers in {made:.1f} s; "
                f"{running} running while measuring"
            )
            stats_rows.append((c.name, f"ListContainerStats@{running}", took))
            c.cleanup()
        for name, op, v in stats_rows:
            print(f"{name:<12} {op:<24} p50 {pct(v, 0.5):8.2f} ms   p90 {pct(v, 0.9):8.2f} ms   (n={len(v)})")

        if args.warm > 0:
            # Warm pause containers (backends/docker/warm.py) serve host-network pods only.
            os.makedirs(f"{tmp}/pooled")
            pool_table = f"\n[handlers.docker.pool]\nsize = {args.warm}\n"
            pooled = Shim(f"{tmp}/pooled", run_id + "-pool", pool_table)
            wsh = Cri("cri-shim+pool", pooled.sock, run_id, logs)
            cris.append(wsh)
            wsh.wait_ready(60)
            time.sleep(2 + 0.3 * args.warm)  # the pool fills
            hn: Samples = {}
            for c in cris:
                if c is not wsh:
                    c.host_network_pod({}, "first")  # first-use costs, untimed
            for _ in range(args.iterations):
                wsh.host_network_pod(hn, "warm")
                sh.host_network_pod(hn, "cold")
                if ctrd:
                    ctrd.host_network_pod(hn, "containerd")
                time.sleep(0.2)  # the pool makes up for what was taken
            print(f"\nRunPodSandbox of a host-network pod, ms (n={args.iterations}; pool of {args.warm})")
            for op in ("warm", "cold", "containerd"):
                v = hn.get(op, [])
                if v:
                    print(f"  cri-shim {op:<12}" if op != "containerd" else f"  {op:<21}", end="")
                    print(f" p50 {pct(v, 0.5):8.2f}   p99 {pct(v, 0.99):8.2f}   (n={len(v)})")
            if hn.get("containerd") and hn.get("warm"):
                ratio = pct(hn["warm"], 0.5) / pct(hn["containerd"], 0.5)
                print(f"  warm / containerd p50: {ratio:.2f}")
        if args.images > 0:
            imaged = [sh, *([ctrd] if ctrd else []), *([crid] if crid else [])]
            images_part(imaged, args.images, args.image_samples)
    except KeyboardInterrupt:
        failed = True
        print("interrupted; cleaning up", file=sys.stderr)
    except Exception:
        failed = True
        raise
    finally:
        for c in imaged:
            remove_bench_images(c)
        for c in cris:
            c.cleanup()
            c.close()
        if raw is not None:
            raw.cleanup()
            raw.close()
        for sm in (shim, pooled):
            if sm is not None:
                sm.stop()
                sm.remove_engine_leftovers()
        if args.keep_tmp:
            print(f"kept {tmp}", file=sys.stderr)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
