"""Under load, side by side: cri-shim (docker backend) vs the raw engine vs containerd-CRI.

For each runtime in turn (two rounds, alternating, so that drift on this
shared machine falls on all alike), W workers run pod + container lifecycles
back to back for D seconds (docker_bench's lifecycle: RunPodSandbox,
CreateContainer, StartContainer, one status round, StopContainer,
RemoveContainer, StopPodSandbox, RemovePodSandbox), while a poller plays the
kubelet's relist: every 20 ms it times Version, ListPodSandbox and
ListContainers. A server that blocks its loop or serializes calls shows up in
the poller's p99 and max. The raw engine (endpoints.Raw: the same work
through the docker SDK, no CRI) runs the lifecycles without a poller: it is
what the engine itself can do at this concurrency.

It prints lifecycles per second, per-operation p50/p99/max under load and the
poller's, for each runtime, and the p50 ratios of cri-shim to the others.
Figures only: nothing is asserted. Everything it creates is removed at the
end, also on failure or Ctrl-C.

Run as root, with scripts/testenv/up (engine, registry) and containerd-CRI
(scripts/testenv/containerd-up, or ../shared/testenv/up):
    .venv/bin/python bench/load_bench.py [--workers 8] [--seconds 20]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import sys
import tempfile
import threading
import time
import uuid

import docker
import grpc

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from endpoints import CONTAINERD_SOCK, OPS, Cri, Raw, Samples, Shim, _interrupt, clock, pct

from cri_api import api_pb2 as pb

POLLED = ["Version", "ListPodSandbox", "ListContainers"]


@dataclasses.dataclass
class Result:
    ops: Samples = dataclasses.field(default_factory=dict)  # lifecycle operations under load
    poll: Samples = dataclasses.field(default_factory=dict)  # the poller's calls
    done: int = 0  # lifecycles completed
    elapsed: float = 0.0
    errors: list[str] = dataclasses.field(default_factory=list)

    def add(self, other: Result) -> None:
        for mine, theirs in ((self.ops, other.ops), (self.poll, other.poll)):
            for op, values in theirs.items():
                mine.setdefault(op, []).extend(values)
        self.done += other.done
        self.elapsed += other.elapsed
        self.errors += other.errors


def run_phase(sock: str, name: str, run_id: str, logs: str, workers: int, seconds: float) -> Result:
    """W workers doing lifecycles and one poller, for ``seconds``; what each measured.

    ``sock`` "" means the raw engine through the SDK (endpoints.Raw), without a poller.
    """
    stop = threading.Event()
    per_worker: list[Samples] = [{} for _ in range(workers)]
    counts = [0] * workers
    out = Result()
    clients: list[Cri | Raw] = [
        Cri(f"{name}-w{i}", sock, f"{run_id}w{i}", logs) if sock else Raw(f"{run_id}w{i}")
        for i in range(workers)
    ]

    def work(i: int) -> None:
        while not stop.is_set():
            try:
                clients[i].lifecycle(per_worker[i], 1)
                counts[i] += 1
            except (grpc.RpcError, docker.errors.APIError) as exc:
                if isinstance(exc, grpc.RpcError):
                    out.errors.append(f"{exc.code().name}: {exc.details()}")
                else:
                    out.errors.append(str(exc))
                time.sleep(0.2)

    def poller() -> None:
        c = Cri(f"{name}-poll", sock, run_id, logs)
        try:
            while not stop.is_set():
                with clock(out.poll, "Version"):
                    c.rt.Version(pb.VersionRequest(), timeout=30)
                with clock(out.poll, "ListPodSandbox"):
                    c.rt.ListPodSandbox(pb.ListPodSandboxRequest(), timeout=30)
                with clock(out.poll, "ListContainers"):
                    c.rt.ListContainers(pb.ListContainersRequest(), timeout=30)
                time.sleep(0.02)
        finally:
            c.close()

    threads = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(workers)]
    if sock:
        threads.append(threading.Thread(target=poller, daemon=True))
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    try:
        time.sleep(seconds)
    finally:
        stop.set()
        for t in threads:
            t.join(180)
        out.elapsed = time.perf_counter() - t0
        for c in clients:
            c.cleanup()
            c.close()
    for s in per_worker:
        for op, values in s.items():
            out.ops.setdefault(op, []).extend(values)
    out.done = sum(counts)
    return out


def report(results: dict[str, Result]) -> None:
    names = list(results)
    print()
    for n in names:
        r = results[n]
        first = f" (first: {r.errors[0]})" if r.errors else ""
        print(
            f"{n:12s} {r.done} lifecycles in {r.elapsed:.0f} s: {r.done / r.elapsed:.2f}/s; "
            f"{len(r.errors)} failed calls{first}"
        )
    base = results[names[0]]
    for n in names[1:]:
        r = results[n]
        print(f"throughput {names[0]}/{n}: {(base.done / base.elapsed) / (r.done / r.elapsed):.2f}x")
    tables: list[tuple[str, list[str], str]] = [
        ("ops", OPS, "lifecycle operations under load"),
        ("poll", POLLED, "poller"),
    ]
    for key, ops, title in tables:
        print(f"\n{title}, ms")
        shown = [n for n in names if getattr(results[n], key)]
        head = f"{'operation':18s}" + "".join(f" | {n + ' p50':>16s} {'p99':>8s} {'max':>8s}" for n in shown)
        others = shown[1:]
        head += "".join(f" | p50 /{o[:6]:>6s}" for o in others)
        print(head)
        print("-" * len(head))
        for op in ops:
            row = f"{op:18s}"
            p50: list[float] = []
            for n in shown:
                v = getattr(results[n], key).get(op, [])
                p50.append(pct(v, 0.5))
                row += f" | {p50[-1]:16.2f} {pct(v, 0.99):8.2f} {max(v) if v else float('nan'):8.2f}"
            row += "".join(f" | {p50[0] / x:12.2f}x" for x in p50[1:])
            print(row)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=8, help="concurrent lifecycle workers (8)")
    ap.add_argument("--seconds", type=float, default=20, help="seconds per runtime per round (20)")
    ap.add_argument("--rounds", type=int, default=2, help="rounds, each runtime once per round (2)")
    ap.add_argument("--containerd", default=CONTAINERD_SOCK, help="containerd CRI socket path")
    args = ap.parse_args()

    run_id = uuid.uuid4().hex[:8]
    tmp = tempfile.mkdtemp(prefix="cri-shim-load-", dir="/tmp")
    logs = f"{tmp}/pod-logs"
    os.makedirs(logs)
    signal.signal(signal.SIGTERM, _interrupt)
    shim = Shim(tmp, run_id)
    try:
        sh = Cri("cri-shim", shim.sock, run_id, logs)
        sh.wait_ready(60)
        sh.pull()
        Raw(run_id).pull()
        targets = [("cri-shim", shim.sock), ("raw engine", "")]
        ctrd = Cri("containerd", args.containerd, run_id, logs)
        if ctrd.answers():
            ctrd.pull()
            targets.append(("containerd", args.containerd))
        else:
            print(f"containerd-CRI: skipped, nothing answers on unix://{args.containerd}")
        ctrd.close()
        sh.close()
        print(
            f"run {run_id}: {args.workers} workers, {args.seconds:.0f} s per runtime per round, "
            f"{args.rounds} rounds, {os.cpu_count()} CPUs"
        )
        results: dict[str, Result] = {name: Result() for name, _ in targets}
        for rnd in range(args.rounds):
            for name, sock in targets:
                print(f"round {rnd + 1}: {name} ...", flush=True)
                results[name].add(run_phase(sock, name, run_id, logs, args.workers, args.seconds))
        report(results)
    except KeyboardInterrupt:
        print("interrupted; cleaning up", file=sys.stderr)
        return 130
    finally:
        shim.stop()
        shim.remove_engine_leftovers()
    return 0


if __name__ == "__main__":
    sys.exit(main())
