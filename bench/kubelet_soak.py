"""A soak of hours under a real kubelet: static pods kept, pods churned, the shim SIGKILLed and restarted.

Starts the tests/e2e/kubelet harness (a private `cri-shim serve` on --handler and
--transport, a standalone kubelet, CRI_SHIM_KUBELET or --kubelet, default
/work/tools/bin/kubelet-1.35, running the harness's static pods) and for --hours:

- watches the long-running static pods (restartPolicy Always, all but `crash`,
  which crash-loops by design): their containers' IDs and restart counts in the
  kubelet's /pods, their READY sandbox in the CRI. A change is an unexpected
  restart; a pod gone from /pods, or whose sandbox is no longer READY, is lost;
- churns --churn pods at a time, each cycle: a manifest written, its pod
  Running (/pods), a command run in it through the kubelet (`POST /run/...`),
  its log read (/containerLogs), the manifest removed, its containers and
  sandbox gone from the CRI (the kubelet's GC removes them within a minute or so);
- every --kill-every minutes SIGKILLs the shim and starts it again at once on
  the same socket and state directory (as a node's supervisor would), then
  times the node's recovery: the shim answering, the kubelet's /healthz ok, a
  PLEG relist begun after the kill (kubelet_pleg_last_seen_seconds), every
  long-running pod Running with its containers unchanged;
- samples every minute the shim's RSS, fds and threads; the kubelet's
  /metrics (kubelet_runtime_operations_errors_total by operation,
  kubelet_pleg_relist_duration_seconds, kubelet_pleg_last_seen_seconds);
  the shim log's non-OK RPCs by method and code and its warning and error events.

At the end it prints one table (errors split into those within a minute of a
kill's recovery and the rest) and removes everything it made, also on Ctrl-C
or SIGTERM. Figures only: nothing is asserted.

Run as root, with scripts/testenv/up's registry:
    .venv/bin/python bench/kubelet_soak.py --hours 2 --handler docker --transport native
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import grpc  # noqa: E402

from cri_api import api_pb2 as pb  # noqa: E402
from tests.e2e import kubelet as kh  # noqa: E402
from tests.e2e.kubelet.pods import container_status, describe  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kubelet_soak_figures import (  # noqa: E402
    Cycle,
    Kill,
    Metrics,
    Sample,
    metric_total,
    parse_metrics,
    report,
)

DEFAULT_KUBELET = "/work/tools/bin/kubelet-1.35"
POD_LABEL = "io.kubernetes.pod.name"
SHIM_LINE = re.compile(r"^(?P<ts>\d{4}-\d\d-\d\dT\S+Z) \[(?P<level>\w+)\s*\] (?P<event>\S+)(?P<rest>.*)$")


class Stopped(Exception):
    """The soak is ending: a wait gave up early."""


class StepFailed(Exception):
    def __init__(self, step: str, detail: str) -> None:
        super().__init__(f"{step}: {detail}")
        self.step = step
        self.detail = detail


def churn_manifest(name: str, token: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": kh.NAMESPACE, "labels": {"soak": "churn"}},
        "spec": {
            "restartPolicy": "Always",
            "terminationGracePeriodSeconds": 2,
            "containers": [
                {
                    "name": "main",
                    "image": kh.BUSYBOX,
                    "imagePullPolicy": "IfNotPresent",
                    "command": ["sh", "-c", f"echo start-{token}; sleep {kh.LONG}"],
                }
            ],
        },
    }


def proc_status(pid: int) -> tuple[float, int, int, float]:
    """RSS in MiB, threads, open fds and user + system CPU seconds of a process (OSError once it is gone)."""
    rss, threads = math.nan, 0
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) / 1024
            elif line.startswith("Threads:"):
                threads = int(line.split()[1])
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()  # after the command, which may hold spaces
    cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime
    return rss, threads, len(os.listdir(f"/proc/{pid}/fd")), cpu


class Soak:
    def __init__(self, h: kh.Harness, args: argparse.Namespace) -> None:
        self.h = h
        self.hours: float = args.hours
        self.kill_every = args.kill_every * 60.0
        self.churn = args.churn
        self.sample_every: float = args.sample_every
        self.recover_timeout: float = args.recover_timeout
        self.stop = threading.Event()
        self.restarting = threading.Event()  # from a SIGKILL until the new shim answers: no shim figures
        self.lock = threading.Lock()
        self.t0 = time.monotonic()
        self.ended: float | None = None
        self.samples: list[Sample] = []
        self.kills: list[Kill] = []
        self.cycles: list[Cycle] = []
        # The long-running pods: their containers' (ID, restart count) and READY sandbox as last seen.
        self.long: list[str] = []
        self.unwatched: dict[str, str] = {}
        self.containers: dict[tuple[str, str], tuple[str, int]] = {}
        self.sandbox: dict[str, str] = {}
        self.restarts: list[str] = []
        self.lost: list[str] = []
        # The shim log: where the last read stopped, and its non-OK RPCs / warning events with their time.
        self.log_offset = 0
        self.log_rest = b""
        self.shim_events: list[tuple[float, str]] = []
        self.threads: list[threading.Thread] = []

    def now(self) -> float:
        return time.monotonic() - self.t0

    def remaining(self) -> float:
        return self.hours * 3600 - self.now()

    def say(self, msg: str) -> None:
        print(f"[{self.now() / 60:7.1f} min] {msg}", flush=True)

    # ------------------------------------------------------------ the long-running pods
    def begin(self, timeout: float = 180.0) -> None:
        """Wait for the long-running pods to run; take their containers and sandboxes as the baseline."""
        h = self.h
        candidates = [n for n, p in h.pods.items() if p["spec"]["restartPolicy"] == "Always" and n != "crash"]
        deadline = time.monotonic() + timeout
        while True:
            pods, sandboxes = self._observe()
            running = {
                n for n in candidates if self._all_running(pods.get(h.full(n))) and sandboxes.get(h.full(n))
            }
            if running == set(candidates) or time.monotonic() > deadline:
                break
            time.sleep(2)
        for name in candidates:
            full = h.full(name)
            if name not in running:
                self.unwatched[name] = self._describe(pods.get(full))
                continue
            self.long.append(name)
            self.sandbox[name] = sorted(sandboxes[full])[0]
            for s in self._statuses(pods[full]):
                self.containers[(name, s["name"])] = (s.get("containerID", ""), int(s.get("restartCount", 0)))
        self.t0 = time.monotonic()

    @staticmethod
    def _statuses(pod: dict[str, Any]) -> list[dict[str, Any]]:
        status = pod.get("status", {})
        return list(status.get("initContainerStatuses") or []) + list(status.get("containerStatuses") or [])

    @staticmethod
    def _all_running(pod: dict[str, Any] | None) -> bool:
        if pod is None:
            return False
        apps = pod.get("status", {}).get("containerStatuses") or []
        return bool(apps) and all("running" in (s.get("state") or {}) for s in apps)

    def _describe(self, pod: dict[str, Any] | None) -> str:
        if pod is None:
            return "not in /pods"
        return "; ".join(f"{s['name']}: {describe(s)}" for s in self._statuses(pod)) or "no status"

    def _observe(self) -> tuple[dict[str, dict[str, Any]], dict[str, set[str]]]:
        """The kubelet's pods by name and the CRI's READY sandboxes by pod name ({} when either fails)."""
        pods = self.h.kubelet_pods()
        try:
            items = self.h.cri().ListPodSandbox(pb.ListPodSandboxRequest(), timeout=10).items
        except grpc.RpcError:
            return pods, {}
        ready: dict[str, set[str]] = collections.defaultdict(set)
        for s in items:
            if s.state == pb.SANDBOX_READY:
                ready[s.labels.get(POD_LABEL, "")].add(s.id)
        return pods, ready

    def watch(self) -> bool:
        """Count restarts and losses of the long-running pods since the last look; True when every one
        of them runs with the containers and sandbox it had."""
        pods, sandboxes = self._observe()
        if not pods or not sandboxes:
            return False  # the kubelet's API or the shim is not answering: nothing to judge
        ok = True
        with self.lock:
            for name in self.long:
                full = self.h.full(name)
                pod = pods.get(full)
                if pod is None:
                    if self.sandbox.get(name) != "":
                        self.lost.append(f"{self.now() / 60:.1f} min: {name} gone from /pods")
                        self.sandbox[name] = ""
                    ok = False
                    continue
                ready = sandboxes.get(full, set())
                if self.sandbox[name] not in ready:
                    ok = False
                    if ready:  # a new sandbox: the kubelet made the pod again
                        new = sorted(ready)[0]
                        self.lost.append(
                            f"{self.now() / 60:.1f} min: {name} sandbox {self.sandbox[name][:12] or '-'} "
                            f"replaced by {new[:12]}"
                        )
                        self.sandbox[name] = new
                for s in self._statuses(pod):
                    key, seen = (name, s["name"]), (s.get("containerID", ""), int(s.get("restartCount", 0)))
                    if not seen[0]:
                        ok = False
                        continue
                    if seen != self.containers.get(key):
                        old = self.containers.get(key, ("", 0))
                        self.restarts.append(
                            f"{self.now() / 60:.1f} min: {name}/{s['name']} {old[0][-12:]} restarts {old[1]} -> "
                            f"{seen[0][-12:]} restarts {seen[1]} ({describe(s)})"
                        )
                        self.containers[key] = seen
                if not self._all_running(pod):
                    ok = False
        return ok

    # ------------------------------------------------------------ waits
    def until(self, step: str, timeout: float, probe: Callable[[], str | None], cycle: Cycle) -> None:
        """Call `probe` every second until it returns None (done); its last answer is the failure's detail.
        Exceptions from the clients are transient: retried and counted."""
        deadline = time.monotonic() + timeout
        begun = time.monotonic()
        detail = "not tried"
        while True:
            if self.stop.is_set():
                raise Stopped
            try:
                answer = probe()
            except (OSError, grpc.RpcError, ValueError) as exc:
                cycle.retries += 1
                answer = f"{type(exc).__name__}: {str(exc)[:200]}"
            else:
                if answer is None:
                    cycle.steps[step] = time.monotonic() - begun
                    return
            detail = answer
            if time.monotonic() > deadline:
                raise StepFailed(step, detail)
            time.sleep(1)

    # ------------------------------------------------------------ churn
    def churner(self, slot: int) -> None:
        n = 0
        while not self.stop.is_set():
            n += 1
            cycle = self.cycle(f"churn{slot}-{n}")
            with self.lock:
                self.cycles.append(cycle)
            if cycle.failed and not cycle.interrupted:
                self.say(f"churn {cycle.name} failed at {cycle.failed}: {cycle.error}")
                self.stop.wait(5)

    def cycle(self, name: str) -> Cycle:
        h = self.h
        c = Cycle(name, self.now())
        full, token = h.full(name), f"{name}-{h.tag}"
        staged = h.dir / "staged" / f"{name}.yaml"
        staged.parent.mkdir(exist_ok=True)
        staged.write_text(json.dumps(churn_manifest(name, token)))
        manifest = h.manifest_dir / f"{name}.yaml"
        os.rename(staged, manifest)  # the kubelet sees it whole

        def running() -> str | None:
            pod = h.kubelet_pods().get(full)
            s = container_status(pod, "main") if pod else None
            if s is not None and "running" in (s.get("state") or {}):
                return None
            return describe(s) if pod else "not in /pods"

        def run() -> str | None:
            status, body = h.api("POST", f"/run/{kh.NAMESPACE}/{full}/main?cmd=echo+{token}", timeout=30)
            return (
                None if status == 200 and body.strip() == token.encode() else f"HTTP {status}: {body[:200]!r}"
            )

        def logs() -> str | None:
            status, body = h.api("GET", f"/containerLogs/{kh.NAMESPACE}/{full}/main", timeout=30)
            return (
                None
                if status == 200 and f"start-{token}".encode() in body
                else f"HTTP {status}: {body[:200]!r}"
            )

        def gone() -> str | None:
            label = {POD_LABEL: full}
            rt = h.cri()
            sandboxes = rt.ListPodSandbox(
                pb.ListPodSandboxRequest(filter=pb.PodSandboxFilter(label_selector=label)), timeout=10
            ).items
            containers = rt.ListContainers(
                pb.ListContainersRequest(filter=pb.ContainerFilter(label_selector=label)), timeout=10
            ).containers
            if not sandboxes and not containers:
                return None
            return f"{len(sandboxes)} sandboxes, {len(containers)} containers left"

        try:
            try:
                self.until("running", 180, running, c)
                self.until("exec", 60, run, c)
                self.until("logs", 60, logs, c)
            except StepFailed as exc:
                c.failed, c.error = exc.step, exc.detail
            manifest.unlink(missing_ok=True)
            try:
                self.until("gone", 300, gone, c)
            except StepFailed as exc:
                c.failed, c.error, c.leaked = c.failed or exc.step, c.error or exc.detail, True
        except Stopped:
            c.interrupted = True
        finally:
            manifest.unlink(missing_ok=True)
            c.ended = self.now()
        return c

    # ------------------------------------------------------------ kills
    def killer(self) -> None:
        next_at = self.kill_every
        while not self.stop.wait(max(0.0, next_at - self.now())):
            if self.remaining() < min(300.0, self.kill_every / 2):
                return  # too close to the end to see the node recover
            self.kill_once()
            next_at = self.now() + self.kill_every

    def kill_once(self) -> None:
        h = self.h
        proc = h.procs["cri-shim"]
        k = Kill(self.now(), time.time(), proc.pid)
        with self.lock:
            self.kills.append(k)
        self.restarting.set()
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        h.procs.pop("cri-shim", None)
        try:
            while True:  # a supervisor restarts it at once, and again if it fails
                try:
                    h.start_shim()
                    break
                except RuntimeError as exc:
                    k.restart_failures.append(str(exc).splitlines()[0][:200])
                    failed = h.procs.pop("cri-shim", None)
                    if failed is not None and failed.poll() is None:
                        failed.kill()
                        failed.wait()
                    if self.stop.wait(2):
                        return
        finally:
            self.restarting.clear()
        k.up_after = self.now() - k.t
        deadline = time.monotonic() + self.recover_timeout
        while not self.stop.is_set():
            missing = self.unrecovered(k)
            if not missing:
                k.recovered_after = self.now() - k.t
                break
            k.missing = missing
            if time.monotonic() > deadline:
                break
            self.stop.wait(1)
        shown = (
            f"recovered after {k.recovered_after:.1f} s"
            if k.recovered_after
            else f"NOT recovered: {k.missing}"
        )
        self.say(f"kill {len(self.kills)} (pid {k.pid}): shim back after {k.up_after:.1f} s, {shown}")

    def unrecovered(self, k: Kill) -> str:
        """What has not come back since kill `k` ("" once all of it has)."""
        try:
            status, body = self.h.api("GET", "/healthz", timeout=10)
            if status != 200:
                return f"/healthz HTTP {status}: {body[:100]!r}"
            metrics = parse_metrics(self.h.api_ok("GET", "/metrics", timeout=20).decode(errors="replace"))
        except (OSError, kh.CheckFailed) as exc:
            return f"kubelet API: {exc}"
        last_seen = metric_total(metrics, "kubelet_pleg_last_seen_seconds")
        if last_seen < math.floor(k.wall) + 1:  # whole seconds: a relist begun after the kill
            return "no PLEG relist since the kill"
        if not self.watch():
            return "long-running pods not all running as before"
        return ""

    # ------------------------------------------------------------ samples
    def sampler(self) -> None:
        while True:
            self.take_sample()
            if self.stop.wait(self.sample_every):
                return

    def take_sample(self) -> Sample:
        h = self.h
        shim, kubelet = h.procs.get("cri-shim"), h.procs.get("kubelet")
        rss = fds = threads = cpu = None
        pid = shim.pid if shim is not None and not self.restarting.is_set() else None
        if pid is not None:
            try:
                rss, threads, fds, cpu = proc_status(pid)
            except OSError:
                pid = None  # killed just now
        kubelet_rss = None
        if kubelet is not None:
            try:
                kubelet_rss = proc_status(kubelet.pid)[0]
            except OSError:
                pass
        try:
            healthz = h.api("GET", "/healthz", timeout=10)[0] == 200
            metrics: Metrics | None = parse_metrics(
                h.api_ok("GET", "/metrics", timeout=20).decode(errors="replace")
            )
        except (OSError, kh.CheckFailed):
            healthz, metrics = False, None
        self.watch()
        self.read_shim_log()
        s = Sample(
            self.now(),
            time.time(),
            pid,
            rss,
            fds,
            threads,
            kubelet_rss,
            healthz,
            metrics,
            os.getloadavg()[0],
            cpu,
        )
        with self.lock:
            self.samples.append(s)
            done = [c for c in self.cycles if not c.interrupted]
            failed = sum(1 for c in done if c.failed)
        pleg = ""
        if metrics is not None:
            pleg = f" pleg_age={s.wall - metric_total(metrics, 'kubelet_pleg_last_seen_seconds'):.0f}s"
        self.say(
            f"shim pid={pid} rss={rss if rss is None else round(rss, 1)}MiB fds={fds} threads={threads} "
            f"healthz={'ok' if healthz else 'FAIL'}{pleg} churn={len(done) - failed}ok/{failed}failed "
            f"kills={len(self.kills)} restarts={len(self.restarts)} lost={len(self.lost)} "
            f"shim_errors={len(self.shim_events)} cpu={cpu if cpu is None else round(cpu, 1)}s load={s.load:.1f}"
        )
        return s

    def read_shim_log(self) -> None:
        try:
            with open(self.h.shim_log, "rb") as f:
                f.seek(self.log_offset)
                data = f.read()
        except OSError:
            return
        self.log_offset += len(data)
        lines = (self.log_rest + data).split(b"\n")
        self.log_rest = lines.pop()
        for raw in lines:
            line = raw.decode(errors="replace")
            m = SHIM_LINE.match(line)
            if m is None:
                if line.startswith("Traceback"):
                    self.shim_events.append((time.time(), "Traceback"))
                continue
            when = datetime.datetime.fromisoformat(m.group("ts")).timestamp()
            rest = m.group("rest")
            if m.group("event") == "rpc":
                code = re.search(r"\bcode=(\S+)", rest)
                if code is not None and code.group(1) != "OK":
                    method = re.search(r"\bmethod=(\S+)", rest)
                    self.shim_events.append(
                        (when, f"rpc {method.group(1) if method else '?'} {code.group(1)}")
                    )
            elif m.group("level") in ("warning", "error", "critical"):
                self.shim_events.append((when, f"{m.group('level')} {m.group('event')}"))

    # ------------------------------------------------------------ the run
    def run(self) -> None:
        self.say(
            f"watching {len(self.long)} long-running pods ({', '.join(self.long)}); "
            f"not watched: {self.unwatched or 'none'}"
        )
        targets: list[tuple[str, Callable[..., None], tuple[Any, ...]]] = [("sampler", self.sampler, ())]
        targets += [(f"churn{i}", self.churner, (i,)) for i in range(self.churn)]
        if self.kill_every > 0:
            targets.append(("killer", self.killer, ()))
        for name, fn, args in targets:
            t = threading.Thread(target=fn, args=args, name=name, daemon=True)
            t.start()
            self.threads.append(t)
        while self.remaining() > 0:
            time.sleep(1)

    def finish(self) -> None:
        """Stop the loops; leave a shim running for the harness's teardown; take the last sample."""
        self.ended = self.now()
        self.stop.set()
        for t in self.threads:
            t.join(timeout=120)
        shim = self.h.procs.get("cri-shim")
        if shim is None or shim.poll() is not None:
            self.h.procs.pop("cri-shim", None)
            self.h.start_shim()
        self.take_sample()


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hours", type=float, default=2.0, help="how long the soak runs (2)")
    ap.add_argument("--handler", choices=kh.HANDLERS, default="docker")
    ap.add_argument("--transport", choices=("native", "grpcio"), default="native", help="the shim's (native)")
    ap.add_argument(
        "--kubelet",
        default=os.environ.get("CRI_SHIM_KUBELET") or DEFAULT_KUBELET,
        help=f"the kubelet binary (CRI_SHIM_KUBELET, else {DEFAULT_KUBELET})",
    )
    ap.add_argument(
        "--kill-every", type=float, default=15.0, help="minutes between SIGKILLs of the shim (15; 0: none)"
    )
    ap.add_argument("--churn", type=int, default=3, help="churned pods at a time (3)")
    ap.add_argument("--sample-every", type=float, default=60.0, help="seconds between samples (60)")
    ap.add_argument(
        "--recover-timeout", type=float, default=300.0, help="seconds a kill's recovery may take (300)"
    )
    ap.add_argument("--keep", action="store_true", help="keep the work directory (logs)")
    args = ap.parse_args()
    os.environ["CRI_SHIM_KUBELET"] = args.kubelet  # what the harness's environment check looks at
    problem = kh.environment_problem(args.handler)
    if problem:
        print(f"cannot run: {problem}", file=sys.stderr)
        return 2
    version = subprocess.run(
        [args.kubelet, "--version"], capture_output=True, text=True, check=False
    ).stdout.strip()
    print(
        f"kubelet soak: {args.hours:g} h, handler {args.handler}, transport {args.transport}, {version}, "
        f"a kill every {args.kill_every:g} min, {args.churn} churned pods; {os.cpu_count()} CPUs, "
        f"load {os.getloadavg()[0]:.1f}, {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC",
        flush=True,
    )
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGHUP, _interrupt)
    h = kh.Harness(
        args.handler,
        kubelet=args.kubelet,
        keep=args.keep,
        node=f"soak-{args.handler}",
        transport=args.transport,
    )
    soak = Soak(h, args)
    started = False
    try:
        h.start()
        soak.begin()
        started = True
        soak.run()
    except KeyboardInterrupt:
        print("interrupted: stopping and cleaning up", flush=True)
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)  # the clean-up runs to its end
        try:
            if started:
                soak.finish()
        finally:
            h.stop()
    if started:
        report(soak, h, args, version)
    return 0


if __name__ == "__main__":
    sys.exit(main())
