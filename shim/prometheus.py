"""The opt-in Prometheus endpoint (``--metrics-listen HOST:PORT``).

What it exports (all prefixed ``cri_shim_``):

- ``grpc_requests_total`` / ``grpc_request_duration_seconds``: every CRI RPC
  by ``method`` and status ``code``, from the servicer's observer;
- ``backend_call_duration_seconds`` by ``handler`` and ``method`` and
  ``backend_errors_total`` by ``handler``, ``method`` and ``error`` (the
  exception class), from a timing proxy around each backend's parts (the
  ``method`` is the part's: ``run_sandbox``, ``pull_image``...). Exec, attach and
  port-forward are not timed: they last as long as the client's session;
- ``pod_sandboxes`` / ``containers`` by ``handler`` and CRI ``state``, read
  from the shim's store at scrape time;
- ``image_pulls_total`` by ``handler`` and ``result``,
  ``image_pull_duration_seconds`` and ``image_pull_bytes_total`` by
  ``handler``. The bytes are the size of the pulled image as its runtime
  reports it (ImageStatus after a successful pull, off the RPC's path), not
  the bytes transferred: a pull of an image already present counts its size;
- ``streaming_sessions``: open exec/attach/port-forward sessions;
- ``log_bytes_dropped_total``: container output that could not be written to
  its CRI log (a full disk); each episode is also logged once per container;
- ``build_info`` and the process collector (memory, CPU, open fds), which
  together with SIGUSR1's stack dump is what one chases a leak with.

Each server gets its own ``CollectorRegistry``, so several can live in one
process (tests). The HTTP endpoint runs on the server's event loop, so
collectors read the store on the thread that mutates it.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import inspect
import socket
import time
from collections.abc import Callable, Iterable
from typing import Any

import structlog
from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector

from backends.contract import Backend
from backends.contract.protocols import PARTS
from backends.contract.proxy import BackendProxy
from cri_api import api_pb2 as pb
from shim import __version__
from shim.cri.servicer import RpcObserver
from shim.server import Server, ServerError

log = structlog.get_logger("metrics")

# RPC latencies: most answer in well under a millisecond; stops with a grace
# period and pulls go to minutes.
RPC_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
PULL_BUCKETS = (0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)
# Backend methods whose duration is a client's session, not a latency.
UNTIMED_METHODS = frozenset({"exec", "attach", "port_forward"})
# The size lookup after a pull must never hang around for a stuck runtime.
SIZE_LOOKUP_TIMEOUT = 10.0
MAX_REQUEST_HEAD = 8192
_DROPPED_HELP = "Container output that could not be written to its CRI log (a full disk), in bytes."
REQUEST_TIMEOUT = 10.0
_CLOSER = "metrics-endpoint-closer"


class ShimMetrics:
    """The metric objects of one server, in their own registry."""

    def __init__(self, server: Server, registry: CollectorRegistry | None = None) -> None:
        self.server = server
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        r = self.registry

        def counter(name: str, doc: str, labels: list[str]) -> Counter:
            return Counter(name, doc, labels, registry=r)

        def histogram(name: str, doc: str, labels: list[str], buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=r)

        self.rpc_total = counter(
            "cri_shim_grpc_requests", "CRI RPCs answered, by method and status code.", ["method", "code"]
        )
        self.rpc_seconds = histogram(
            "cri_shim_grpc_request_duration_seconds",
            "Time to answer a CRI RPC, by method and status code.",
            ["method", "code"],
            RPC_BUCKETS,
        )
        self.backend_seconds = histogram(
            "cri_shim_backend_call_duration_seconds",
            "Duration of calls into a backend (runtime handler), by handler and method.",
            ["handler", "method"],
            RPC_BUCKETS,
        )
        self.backend_errors = counter(
            "cri_shim_backend_errors",
            "Backend calls that raised, by handler, method and exception class.",
            ["handler", "method", "error"],
        )
        self.pulls = counter(
            "cri_shim_image_pulls",
            "Image pulls by handler and result (success, error).",
            ["handler", "result"],
        )
        self.pull_seconds = histogram(
            "cri_shim_image_pull_duration_seconds",
            "Duration of image pulls by the backend, by handler.",
            ["handler"],
            PULL_BUCKETS,
        )
        self.pull_bytes = counter(
            "cri_shim_image_pull_bytes",
            "Size of successfully pulled images, as their runtime reports it, by handler.",
            ["handler"],
        )
        r.register(_StateCollector(server))
        ProcessCollector(namespace="cri_shim", registry=r)
        self._size_lookups: set[asyncio.Task[None]] = set()

    # ------------------------------------------------------------------ RPCs
    def observe_rpc(self, method: str, code: str, seconds: float) -> None:
        self.rpc_total.labels(method, code).inc()
        self.rpc_seconds.labels(method, code).observe(seconds)

    # ------------------------------------------------------------------ backends
    def wrap_backend(self, backend: Backend) -> Backend:
        return TimedBackend(backend, self)

    def pulled(self, backend: Backend, image: pb.ImageSpec, ref: str, seconds: float) -> None:
        self.pulls.labels(backend.name, "success").inc()
        self.pull_seconds.labels(backend.name).observe(seconds)
        task = asyncio.get_running_loop().create_task(self._count_size(backend, image, ref))
        self._size_lookups.add(task)
        task.add_done_callback(self._size_lookups.discard)

    def pull_failed(self, backend: Backend, seconds: float) -> None:
        self.pulls.labels(backend.name, "error").inc()
        self.pull_seconds.labels(backend.name).observe(seconds)

    async def _count_size(self, backend: Backend, image: pb.ImageSpec, ref: str) -> None:
        # Asked of the unwrapped backend, so the lookup is not counted as a call of the shim's.
        images = backend.images
        if images is None:
            return
        spec = pb.ImageSpec()
        spec.CopyFrom(image)
        if ref:
            spec.image = ref
        try:
            async with asyncio.timeout(SIZE_LOOKUP_TIMEOUT):
                found = await images.image_status(spec)
        except Exception as exc:
            log.debug("metrics.image_size_unknown", image=image.image, error=str(exc))
            return
        if found is not None and found.size:
            self.pull_bytes.labels(backend.name).inc(found.size)

    def cancel_size_lookups(self) -> None:
        for task in self._size_lookups:
            task.cancel()

    async def wait_size_lookups(self) -> None:
        """For tests and shutdown: the pending image size lookups have finished."""
        if self._size_lookups:
            await asyncio.gather(*self._size_lookups, return_exceptions=True)

    # ------------------------------------------------------------------ exposition
    def render(self, accept: str) -> tuple[bytes, str]:
        encoder, content_type = choose_encoder(accept)
        return encoder(self.registry), content_type


class TimedBackend(BackendProxy):
    """A Backend that times every coroutine method of the parts of the one it wraps.

    Its other attributes (``name``, ``capabilities``, a fake's spy helpers, ...) are read
    from and written to the wrapped backend, so the shim and tests see no
    difference; coroutine methods stay coroutine functions.
    """

    def __init__(self, inner: Backend, metrics: ShimMetrics) -> None:
        self._metrics = metrics
        super().__init__(inner, self._around)

    def _around(self, method: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        if method in UNTIMED_METHODS or not inspect.iscoroutinefunction(fn):
            return fn
        if method == "pull_image":
            return _timed_pull(self._inner, self._metrics, fn)
        return _timed(self._inner, self._metrics, method, fn)

    def __getattr__(self, attr: str) -> Any:
        # Only for what this object lacks (its own names are set first, in __init__).
        if attr.startswith("_"):
            raise AttributeError(attr)
        return getattr(self._inner, attr)

    def __setattr__(self, attr: str, value: Any) -> None:
        if attr.startswith("_") or attr in PARTS:
            object.__setattr__(self, attr, value)
        else:
            setattr(self._inner, attr, value)


def _timed(inner: Backend, metrics: ShimMetrics, method: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    async def call(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return await fn(*args, **kwargs)
        except Exception as exc:
            metrics.backend_errors.labels(inner.name, method, type(exc).__name__).inc()
            raise
        finally:
            metrics.backend_seconds.labels(inner.name, method).observe(time.perf_counter() - t0)

    call.__name__ = method
    return call


def _timed_pull(inner: Backend, metrics: ShimMetrics, fn: Callable[..., Any]) -> Callable[..., Any]:
    """_timed's backend figures, plus the pull's own (count, size, duration by outcome)."""
    timed = _timed(inner, metrics, "pull_image", fn)

    async def pull_image(image: pb.ImageSpec, *args: Any, **kwargs: Any) -> str:
        t0 = time.perf_counter()
        try:
            ref: str = await timed(image, *args, **kwargs)
        except Exception:
            metrics.pull_failed(inner, time.perf_counter() - t0)
            raise
        metrics.pulled(inner, image, ref, time.perf_counter() - t0)
        return ref

    return pull_image


class _StateCollector(Collector):
    """Pods, containers and streaming sessions, counted at scrape time."""

    def __init__(self, server: Server) -> None:
        self.server = server

    def describe(self) -> Iterable[Metric]:
        # Declared without samples so that registration does not call collect().
        return [
            GaugeMetricFamily("cri_shim_pod_sandboxes", "Pod sandboxes by runtime handler and CRI state."),
            GaugeMetricFamily("cri_shim_containers", "Containers by runtime handler and CRI state."),
            GaugeMetricFamily("cri_shim_streaming_sessions", "Open exec, attach and port-forward sessions."),
            GaugeMetricFamily("cri_shim_build_info", "The running cri-shim's version."),
            CounterMetricFamily("cri_shim_log_bytes_dropped", _DROPPED_HELP),
            *_warm_pools(()),
        ]

    def collect(self) -> Iterable[Metric]:
        info = GaugeMetricFamily("cri_shim_build_info", "The running cri-shim's version.", labels=["version"])
        info.add_metric([__version__], 1)
        yield info
        pods = GaugeMetricFamily(
            "cri_shim_pod_sandboxes",
            "Pod sandboxes by runtime handler and CRI state.",
            labels=["handler", "state"],
        )
        containers = GaugeMetricFamily(
            "cri_shim_containers", "Containers by runtime handler and CRI state.", labels=["handler", "state"]
        )
        shim = self.server.shim
        if shim is not None:
            handlers = shim.registry.names()
            pod_counts = _zeroes(handlers, pb.PodSandboxState.keys())
            for sb in list(shim.store.sandboxes.values()):
                key = (sb.backend, pb.PodSandboxState.Name(sb.state))
                pod_counts[key] = pod_counts.get(key, 0) + 1
            ctr_counts = _zeroes(handlers, pb.ContainerState.keys())
            for c in list(shim.store.containers.values()):
                key = (c.backend, pb.ContainerState.Name(c.state))
                ctr_counts[key] = ctr_counts.get(key, 0) + 1
            for (handler, state), n in sorted(pod_counts.items()):
                pods.add_metric([handler, state], n)
            for (handler, state), n in sorted(ctr_counts.items()):
                containers.add_metric([handler, state], n)
        yield pods
        yield containers
        if shim is not None:
            dropped = CounterMetricFamily("cri_shim_log_bytes_dropped", _DROPPED_HELP)
            dropped.add_metric([], shim.io.log_bytes_dropped)
            yield dropped
        if shim is not None:
            yield from _warm_pools(shim.registry.items())
        streaming = self.server.streaming
        if streaming is not None:
            sessions = GaugeMetricFamily(
                "cri_shim_streaming_sessions", "Open exec, attach and port-forward sessions."
            )
            sessions.add_metric([], int(streaming.open_sessions))
            yield sessions


def _warm_pools(backends: Iterable[tuple[str, Backend]]) -> Iterable[Metric]:
    """Sandboxes made ahead of their pods, per handler that keeps a pool."""
    ready = GaugeMetricFamily(
        "cri_shim_warm_sandboxes_ready", "Sandboxes made ahead of their pods, ready.", labels=["handler"]
    )
    wanted = GaugeMetricFamily(
        "cri_shim_warm_sandboxes_wanted", "How many the pool keeps ready (its size).", labels=["handler"]
    )
    taken = CounterMetricFamily(
        "cri_shim_warm_sandboxes_taken", "RunPodSandbox calls served by a warm sandbox.", labels=["handler"]
    )
    for name, backend in backends:
        figures = backend.warm_figures()
        if figures is not None:
            ready.add_metric([name], figures.ready)
            wanted.add_metric([name], figures.size)
            taken.add_metric([name], figures.handed_out)
    yield from (ready, wanted, taken)


def _zeroes(handlers: Iterable[str], states: Iterable[str]) -> dict[tuple[str, str], int]:
    # Every (handler, state) pair is exported, so a dashboard sees 0 rather than no series.
    return {(h, s): 0 for h in handlers for s in states}


# --------------------------------------------------------------------------- HTTP


def parse_listen(listen: str) -> tuple[str, int]:
    """HOST:PORT or [V6]:PORT → (host, port); an empty host means all addresses."""
    host, sep, port_s = listen.rpartition(":")
    if not sep or not port_s.isdigit() or int(port_s) > 65535:
        raise ValueError(f"--metrics-listen {listen!r}: expected HOST:PORT, e.g. 127.0.0.1:9090")
    host = host.strip("[]")
    return host, int(port_s)


class MetricsEndpoint:
    """The HTTP server of /metrics, on the event loop of the CRI server."""

    def __init__(self, metrics: ShimMetrics, sock: socket.socket) -> None:
        self.metrics = metrics
        self._sock = sock
        self._server: asyncio.Server | None = None
        self._closed = asyncio.Event()
        self.tasks: list[asyncio.Task[None]] = []
        addr = sock.getsockname()
        self.host: str = addr[0]
        self.port: int = addr[1]

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    async def serve(self) -> None:
        self._server = await asyncio.start_server(self._handle, sock=self._sock, limit=MAX_REQUEST_HEAD)
        log.info("metrics.listening", url=self.url)
        await self._closed.wait()
        self._server.close()
        await self._server.wait_closed()

    def close(self) -> None:
        """Stop listening; idempotent. ``wait_closed`` waits for it."""
        self._closed.set()
        if self._server is None:
            self._sock.close()
        current = asyncio.current_task()
        for task in self.tasks:
            if task is not current and task.get_name() == _CLOSER:
                task.cancel()

    async def wait_closed(self) -> None:
        await asyncio.gather(*self.tasks, return_exceptions=True)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(REQUEST_TIMEOUT):
                head = await reader.readuntil(b"\r\n\r\n")
            status, headers, body = self._respond(head)
            writer.write(_http_response(status, headers, body))
            await writer.drain()
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError, ConnectionError):
            pass
        except Exception:
            log.exception("metrics.request_failed")
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    def _respond(self, head: bytes) -> tuple[int, list[tuple[str, str]], bytes]:
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split()
        if len(parts) != 3:
            return 400, [], b"bad request\n"
        method, target, _ = parts
        headers = {}
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if sep:
                headers[name.strip().lower()] = value.strip()
        path = target.split("?", 1)[0]
        if method not in ("GET", "HEAD"):
            return 405, [("Allow", "GET, HEAD")], b"method not allowed\n"
        if path == "/":
            return 200, [("Content-Type", "text/plain; charset=utf-8")], b"cri-shim: see /metrics\n"
        if path != "/metrics":
            return 404, [], b"not found\n"
        body, content_type = self.metrics.render(headers.get("accept", ""))
        out = [("Content-Type", content_type)]
        if "gzip" in headers.get("accept-encoding", ""):
            body = gzip.compress(body, compresslevel=5)
            out.append(("Content-Encoding", "gzip"))
        if method == "HEAD":
            return 200, [*out, ("Content-Length", str(len(body)))], b""
        return 200, out, body


_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed"}


def _http_response(status: int, headers: list[tuple[str, str]], body: bytes) -> bytes:
    lines = [f"HTTP/1.1 {status} {_REASONS.get(status, '')}", "Connection: close"]
    if not any(k == "Content-Length" for k, _ in headers):
        headers = [*headers, ("Content-Length", str(len(body)))]
    lines += [f"{k}: {v}" for k, v in headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def _bind(host: str, port: int) -> socket.socket:
    # Bound now, synchronously, so that a taken port fails `cri-shim serve` at once.
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6 and not host:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind((host or "0.0.0.0", port))
        sock.listen(64)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


def start(listen: str, server: Server) -> MetricsEndpoint:
    """Instrument ``server`` and serve /metrics on ``listen`` (HOST:PORT).

    Must be called on the server's event loop, before the server starts: the
    RPC observer and the backend proxy are installed at startup. The endpoint
    closes when the server stops.
    """
    if server.shim is not None:
        raise RuntimeError("metrics.start must be called before the server starts")
    try:
        host, port = parse_listen(listen)
        sock = _bind(host, port)
    except ValueError as exc:
        raise ServerError(str(exc)) from None
    except OSError as exc:
        raise ServerError(f"--metrics-listen {listen}: {exc.strerror or exc}") from None
    metrics = ShimMetrics(server)
    server._observer = _chain_observers(server._observer, metrics.observe_rpc)
    previous_wrap = server.wrap_backend
    if previous_wrap is None:
        server.wrap_backend = metrics.wrap_backend
    else:
        server.wrap_backend = lambda b: metrics.wrap_backend(previous_wrap(b))
    endpoint = MetricsEndpoint(metrics, sock)
    loop = asyncio.get_running_loop()
    endpoint.tasks = [
        loop.create_task(endpoint.serve(), name="metrics-endpoint"),
        loop.create_task(_close_with(server, endpoint), name=_CLOSER),
    ]
    return endpoint


async def _close_with(server: Server, endpoint: MetricsEndpoint) -> None:
    await server._stopped.wait()
    endpoint.metrics.cancel_size_lookups()
    endpoint.close()


def _chain_observers(first: RpcObserver | None, second: RpcObserver) -> RpcObserver:
    if first is None:
        return second

    def both(method: str, code: str, seconds: float) -> None:
        first(method, code, seconds)
        second(method, code, seconds)

    return both


__all__ = ["MetricsEndpoint", "ShimMetrics", "TimedBackend", "start"]
