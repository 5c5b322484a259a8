"""The figures of bench/kubelet_soak.py: what a soak records, the kubelet's metrics read, and the table.

Errors are split in two: those within a kill's window (from the SIGKILL to a
minute after the node recovered), which the kill explains, and the rest.
PLEG relist quantiles come from the kubelet's histogram buckets, as Prometheus'
histogram_quantile computes them (linear within a bucket: coarse, the buckets
being 5, 10, 25, 50, 100 ms...); the mean (sum / count) is exact.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import itertools
import math
import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kubelet_soak import Soak

    from tests.e2e import kubelet as kh

PLEG_THRESHOLD = 180.0  # the kubelet's generic PLEG calls itself unhealthy past this (relistThreshold)
AFTER_RECOVERY = 60.0  # errors this long after a kill's recovery are put down to the kill
Labels = tuple[tuple[str, str], ...]
Metrics = dict[str, dict[Labels, float]]
FAMILIES = (
    "kubelet_runtime_operations_errors_total",
    "kubelet_pleg_relist_duration_seconds_bucket",
    "kubelet_pleg_relist_duration_seconds_count",
    "kubelet_pleg_relist_duration_seconds_sum",
    "kubelet_pleg_last_seen_seconds",
)
SAMPLE_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})?\s+(\S+)")
LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


@dataclasses.dataclass
class Sample:
    t: float  # seconds since the soak began
    wall: float
    pid: int | None  # the shim's
    rss: float | None  # MiB
    fds: int | None
    threads: int | None
    kubelet_rss: float | None
    healthz: bool
    metrics: Metrics | None
    load: float  # the host's 1-minute load average: other work on the machine
    cpu: float | None = None  # the shim's user + system CPU seconds so far


@dataclasses.dataclass
class Kill:
    t: float
    wall: float
    pid: int
    up_after: float | None = None  # the new shim answered Version
    recovered_after: float | None = None  # /healthz, PLEG, long-running pods: all back
    restart_failures: list[str] = dataclasses.field(default_factory=list)
    missing: str = ""  # what had not recovered, when it did not


@dataclasses.dataclass
class Cycle:
    name: str
    began: float
    ended: float = 0.0
    failed: str = ""  # the step that failed ("" = the cycle went through)
    error: str = ""
    interrupted: bool = False  # the soak ended during it: not counted
    leaked: bool = False  # its sandbox or containers still in the CRI when the cycle gave up
    retries: int = 0  # transient errors that a retry got past
    steps: dict[str, float] = dataclasses.field(default_factory=dict)


def parse_metrics(text: str) -> Metrics:
    out: Metrics = {f: {} for f in FAMILIES}
    for line in text.splitlines():
        m = SAMPLE_LINE.match(line)
        if m is None or m.group(1) not in out:
            continue
        labels = tuple(sorted(LABEL.findall(m.group(2) or "")))
        try:
            out[m.group(1)][labels] = float(m.group(3))
        except ValueError:
            continue
    return out


def metric_total(m: Metrics, family: str) -> float:
    return sum(m.get(family, {}).values())


def relist_quantile(first: Metrics, last: Metrics, q: float) -> float:
    """The q-quantile of the PLEG relists between two samples, from the histogram's buckets
    (linear within a bucket, as Prometheus' histogram_quantile)."""
    family = "kubelet_pleg_relist_duration_seconds_bucket"
    buckets: list[tuple[float, float]] = []
    for labels, value in last[family].items():
        le = float(dict(labels)["le"])
        buckets.append((le, value - first[family].get(labels, 0.0)))
    buckets.sort()
    if not buckets or buckets[-1][1] <= 0:
        return math.nan
    rank = q * buckets[-1][1]
    prev_le, prev_n = 0.0, 0.0
    for le, n in buckets:
        if n >= rank:
            if math.isinf(le):
                return prev_le
            return le if n == prev_n else prev_le + (le - prev_le) * (rank - prev_n) / (n - prev_n)
        prev_le, prev_n = le, n
    return prev_le


def within_kill(soak: Soak, wall_from: float, wall_to: float) -> bool:
    """Whether [wall_from, wall_to] meets a kill's window: from the kill to a minute after its recovery."""
    for k in soak.kills:
        end = k.wall + (k.recovered_after or soak.recover_timeout) + AFTER_RECOVERY
        if wall_from <= end and wall_to >= k.wall:
            return True
    return False


def _fmt(x: float | None, spec: str = ".1f") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def _p50(values: list[float]) -> float | None:
    return sorted(values)[len(values) // 2] if values else None


def _counts(counter: collections.Counter[str], limit: int = 8) -> str:
    if not counter:
        return "none"
    shown = ", ".join(f"{k} {n}" for k, n in counter.most_common(limit))
    more = len(counter) - limit
    return shown + (f", +{more} more kinds" if more > 0 else "")


def report(soak: Soak, h: kh.Harness, args: argparse.Namespace, version: str) -> None:
    duration = soak.ended if soak.ended is not None else soak.now()
    done = [c for c in soak.cycles if not c.interrupted]
    failed = [c for c in done if c.failed]
    kills = soak.kills
    samples = list(soak.samples)
    metric_samples = [s for s in samples if s.metrics is not None]
    rows: list[tuple[str, str]] = [
        ("handler, transport", f"{args.handler}, {args.transport} ({version})"),
        ("duration", f"{duration / 3600:.2f} h ({duration / 60:.0f} min)"),
        (
            "churn cycles",
            f"{len(done) - len(failed)} ok, {len(failed)} failed, {sum(c.leaked for c in done)} leaked",
        ),
    ]
    for step in ("running", "exec", "logs", "gone"):
        rows.append((f"  churn step {step} p50 / max", _step_times(done, step)))
    rows.append(("  churn transient errors retried", str(sum(c.retries for c in done))))
    up = [k.up_after for k in kills if k.up_after is not None]
    rec = [k.recovered_after for k in kills if k.recovered_after is not None]
    # Churn went on: a cycle finished whole after the node recovered from the kill.
    churn_after = sum(
        1
        for k in kills
        if k.recovered_after is not None
        and any(not c.failed and c.ended > k.t + k.recovered_after for c in done)
    )
    rows += [
        ("kills (SIGKILL + restart)", f"{len(kills)}, every {args.kill_every:g} min"),
        ("  shim answering after p50 / max", f"{_fmt(_p50(up))} / {_fmt(max(up, default=None))} s"),
        (
            "  node recovered after p50 / max",
            f"{_fmt(_p50(rec))} / {_fmt(max(rec, default=None))} s; {len(rec)}/{len(kills)} recovered",
        ),
        ("  restarts that failed", str(sum(len(k.restart_failures) for k in kills))),
        ("  kills followed by a whole churn cycle", f"{churn_after}/{len(kills)}"),
        ("unexpected restarts", f"{len(soak.restarts)} (of {len(soak.containers)} containers watched)"),
        ("lost pods", f"{len(soak.lost)} (of {len(soak.long)} long-running pods)"),
    ]
    kubelet_near, kubelet_far = collections.Counter[str](), collections.Counter[str]()
    for a, b in itertools.pairwise(metric_samples):
        assert a.metrics is not None and b.metrics is not None
        near = within_kill(soak, a.wall, b.wall)
        for labels, value in b.metrics["kubelet_runtime_operations_errors_total"].items():
            delta = int(value - a.metrics["kubelet_runtime_operations_errors_total"].get(labels, 0.0))
            if delta > 0:
                (kubelet_near if near else kubelet_far)[dict(labels).get("operation_type", "?")] += delta
    shim_near, shim_far = collections.Counter[str](), collections.Counter[str]()
    for when, kind in soak.shim_events:
        (shim_near if within_kill(soak, when, when) else shim_far)[kind] += 1
    churn_errors = collections.Counter(f"{c.failed}" for c in failed)
    rows += [
        (
            "errors: kubelet runtime operations",
            f"{sum(kubelet_far.values())} away from kills: {_counts(kubelet_far)}",
        ),
        ("", f"{sum(kubelet_near.values())} near kills: {_counts(kubelet_near)}"),
        (
            "errors: shim log (non-OK RPCs, warnings)",
            f"{sum(shim_far.values())} away from kills: {_counts(shim_far)}",
        ),
        ("", f"{sum(shim_near.values())} near kills: {_counts(shim_near)}"),
        ("errors: churn steps failed", _counts(churn_errors)),
        ("errors: kubelet E-lines (whole log)", str(sum(h.kubelet_errors().values()))),
    ]
    rss = [s.rss for s in samples if s.rss is not None]
    fds = [s.fds for s in samples if s.fds is not None]
    threads = [s.threads for s in samples if s.threads is not None]
    kubelet_rss = [s.kubelet_rss for s in samples if s.kubelet_rss is not None]
    rows += [
        (
            "shim RSS MiB first / max / last",
            f"{_fmt(rss[0] if rss else None)} / {_fmt(max(rss, default=None))} / {_fmt(rss[-1] if rss else None)}",
        ),
        (
            "shim fds first / last (max)",
            f"{fds[0] if fds else '-'} / {fds[-1] if fds else '-'} ({max(fds, default='-')})",
        ),
        (
            "shim threads first / last (max)",
            f"{threads[0] if threads else '-'} / {threads[-1] if threads else '-'} ({max(threads, default='-')})",
        ),
        (
            "kubelet RSS MiB first / last",
            f"{_fmt(kubelet_rss[0] if kubelet_rss else None)} / {_fmt(kubelet_rss[-1] if kubelet_rss else None)}",
        ),
    ]
    lives: dict[int, list[Sample]] = {}
    for s in samples:
        if s.pid is not None and s.rss is not None:
            lives.setdefault(s.pid, []).append(s)
    for pid, life in lives.items():
        rows.append(
            (
                f"  shim life pid {pid}",
                f"{(life[-1].t - life[0].t) / 60:.0f} min sampled: RSS {life[0].rss:.1f} -> {life[-1].rss:.1f} MiB, "
                f"fds {life[0].fds} -> {life[-1].fds}, threads {life[0].threads} -> {life[-1].threads}, "
                f"CPU {_cpu_share(life)}",
            )
        )
    window = min(3600.0, duration / 2)
    if len(metric_samples) >= 2:
        first = metric_samples[0]
        first_end = next((s for s in metric_samples if s.t >= first.t + window), metric_samples[-1])
        last = metric_samples[-1]
        last_start = [s for s in metric_samples if s.t <= last.t - window] or [metric_samples[0]]
        for label, a, b in (("first", first, first_end), ("last", last_start[-1], last)):
            assert a.metrics is not None and b.metrics is not None
            n = metric_total(b.metrics, "kubelet_pleg_relist_duration_seconds_count") - metric_total(
                a.metrics, "kubelet_pleg_relist_duration_seconds_count"
            )
            total = metric_total(b.metrics, "kubelet_pleg_relist_duration_seconds_sum") - metric_total(
                a.metrics, "kubelet_pleg_relist_duration_seconds_sum"
            )
            loads = [s.load for s in samples if a.t <= s.t <= b.t]
            rows.append(
                (
                    f"PLEG relist p50 / p99 / mean, {label} {window / 60:.0f} min",
                    f"{_fmt(relist_quantile(a.metrics, b.metrics, 0.5) * 1000)} / "
                    f"{_fmt(relist_quantile(a.metrics, b.metrics, 0.99) * 1000)} / "
                    f"{_fmt(total / n * 1000 if n else None)} ms ({n:.0f} relists, min {a.t / 60:.0f}-{b.t / 60:.0f}, "
                    f"host load {sum(loads) / len(loads):.1f})",
                )
            )
    ages = [
        s.wall - metric_total(s.metrics, "kubelet_pleg_last_seen_seconds")
        for s in metric_samples
        if s.metrics
    ]
    rows += [
        (
            "PLEG last seen, oldest at a sample",
            f"{_fmt(max(ages, default=None), '.0f')} s (unhealthy past {PLEG_THRESHOLD:.0f} s)",
        ),
        ("/healthz failed at samples", f"{sum(1 for s in samples if not s.healthz)}/{len(samples)}"),
    ]
    width = max(len(k) for k, _ in rows)
    print(f"\n== kubelet soak: {args.handler} on {args.transport}, node {h.node} ==")
    for k, v in rows:
        print(f"{k:<{width}} | {v}")
    for title, items in (
        ("unexpected restarts", soak.restarts),
        ("lost pods", soak.lost),
        (
            "kills not recovered",
            [f"{k.t / 60:.1f} min: {k.missing}" for k in kills if k.recovered_after is None],
        ),
        ("failed restarts", [f"{k.t / 60:.1f} min: {r}" for k in kills for r in k.restart_failures]),
        (
            "churn failures (first 10)",
            [f"{c.name} at {c.began / 60:.1f} min: {c.failed}: {c.error}" for c in failed][:10],
        ),
        (
            "kubelet E-lines (most frequent 10)",
            [f"{n:>5}  {line}" for line, n in h.kubelet_errors().most_common(10)],
        ),
    ):
        if items:
            print(f"-- {title}")
            for item in items:
                print(f"   {item}")


def _cpu_share(life: list[Sample]) -> str:
    """The shim's CPU use over one life's samples, in percent of one core."""
    timed = [s for s in life if s.cpu is not None]
    if len(timed) < 2 or timed[-1].t <= timed[0].t:
        return "-"
    assert timed[0].cpu is not None and timed[-1].cpu is not None
    return f"{100 * (timed[-1].cpu - timed[0].cpu) / (timed[-1].t - timed[0].t):.1f}%"


def _step_times(cycles: list[Cycle], step: str) -> str:
    times = [c.steps[step] for c in cycles if step in c.steps]
    return f"{_fmt(_p50(times))} / {_fmt(max(times, default=None))} s"
