"""The gRPC edge: one table of RPCs, condition → status code mapping, one log event per RPC.

Every RPC of RuntimeService and ImageService is registered here, by name,
with the service method that answers it; each transport serves this one
table (grpcio's generic handlers are built from it in
:mod:`shim.transport.grpcio`). Codes are :class:`shim.cri.codes.Code`, so
that this module needs no grpc. Each call:

- is decoded leniently: a request that is not valid protobuf (bad wire
  data, non-UTF-8 strings) becomes INVALID_ARGUMENT, not INTERNAL;
- has its CriError mapped to its status code; any other exception is a
  bug, logged with its traceback and answered UNKNOWN with a short message;
- is logged once, with method, IDs, duration and code — mutating RPCs at
  info, polled ones at debug.

The polled RPCs of pods, containers and the runtime are answered by
:mod:`shim.cri.answers` (encoded answers, kept while nothing changed); every
other RPC by its service. The Stream* RPCs (cri-api 0.36) carry the same
filter as their List twins and the same repeated field 1 in their responses:
each is its List's entries, sent in chunks.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterator
from typing import Any, Protocol

import structlog
from google.protobuf.message import DecodeError, Message

from cri_api import api_pb2 as pb
from shim.cri.answers import EncodedAnswers, EncodedImages, field1_entry
from shim.cri.checkpoint import CheckpointService
from shim.cri.codes import Code
from shim.cri.container import ContainerService
from shim.cri.errors import CriError, InvalidArgumentError, status_code
from shim.cri.image import ImageService
from shim.cri.runtime import RuntimeService
from shim.cri.sandbox import SandboxService
from shim.cri.state import Shim
from shim.logging import debug_enabled

log = structlog.get_logger("rpc")

RUNTIME_SERVICE = "runtime.v1.RuntimeService"
IMAGE_SERVICE = "runtime.v1.ImageService"

STREAM_CHUNK_BYTES = 1024 * 1024
_ID_FIELDS = ("pod_sandbox_id", "container_id")

RpcObserver = Callable[[str, str, float], None]
_OK = Code.OK  # a module's name: Code.OK, read off the enum class, is ~80 ns, and each call compares it
# Types of what RPC methods returned that are not coroutines: asyncio.iscoroutine() is ~0.3 us
# for them (an ABC check), a set lookup ~0.03 us. As few as the response types.
_NOT_COROUTINES: set[type] = set()
# How a unary call ended: its code, the error's detail ("" if none), its response.
Settled = tuple[Code, str, Any]


class AbortContext(Protocol):
    """What a stream handler needs of its call: a way to end it with a status (the transport's)."""

    async def abort(self, code: Code, details: str = "") -> None: ...


StreamHandler = Callable[[Any, AbortContext], AsyncGenerator[Any, None]]


class Undecodable:
    """What the lenient deserializer returns for bytes that are not the request type: why not."""

    def __init__(self, error: str) -> None:
        self.error = error


def _deserializer(cls: type[Message]) -> Callable[[bytes], Message | Undecodable]:
    def decode(data: bytes) -> Message | Undecodable:
        try:
            return cls.FromString(data)
        except (DecodeError, UnicodeDecodeError, ValueError) as exc:
            return Undecodable(str(exc) or type(exc).__name__)

    return decode


def _require_valid(rpc: Rpc, req: Message | Undecodable) -> None:
    if isinstance(req, Undecodable):
        raise InvalidArgumentError(f"malformed {rpc.name} request: {req.error}")


def serialize(resp: Message | bytes) -> bytes:
    return resp if isinstance(resp, bytes) else resp.SerializeToString()


def _chunked(entries: Callable[[Any], Any]) -> Callable[[Any], AsyncIterator[bytes]]:
    """A Stream* RPC: the entries of its List twin's answer (or the awaitable of them), in
    chunks of at most STREAM_CHUNK_BYTES, each a valid encoding of the Stream response."""

    async def stream(req: Any) -> AsyncIterator[bytes]:
        got = entries(req)
        if asyncio.iscoroutine(got):
            got = await got
        chunk: list[bytes] = []
        size = 0
        for entry in got:
            if chunk and size + len(entry) > STREAM_CHUNK_BYTES:
                yield b"".join(chunk)
                chunk, size = [], 0
            chunk.append(entry)
            size += len(entry)
        if chunk:
            yield b"".join(chunk)

    return stream


def _entries_of(answer: Callable[[Any], Awaitable[Message]]) -> Callable[[Any], Awaitable[list[bytes]]]:
    """The encoded elements of field 1 (the listed items) of what a List RPC answers."""

    async def entries(req: Any) -> list[bytes]:
        resp = await answer(req)
        (listed,) = [f.name for f in resp.DESCRIPTOR.fields if f.number == 1]
        return [field1_entry(item.SerializeToString()) for item in getattr(resp, listed)]

    return entries


class Outcome:
    """How one call ended, filled in by CriServicer._outcome."""

    __slots__ = ("code", "detail", "response")

    def __init__(self) -> None:
        self.code = Code.OK
        self.detail = ""
        self.response: Any = None


class Rpc:
    __slots__ = ("decode", "fn", "name", "polled", "request", "stream")

    def __init__(
        self, name: str, request: type[Message], fn: Callable[[Any], Any], polled: bool, stream: bool = False
    ) -> None:
        self.name = name
        self.request = request
        self.fn = fn
        self.polled = polled
        self.stream = stream
        self.decode = _deserializer(request)


class CriServicer:
    def __init__(self, shim: Shim, observer: RpcObserver | None = None) -> None:
        self.shim = shim
        self.observer = observer
        rt = RuntimeService(shim)
        sb = SandboxService(shim)
        ct = ContainerService(shim)
        im = ImageService(shim)
        cp = CheckpointService(shim, sb, ct)
        fast, fast_images = EncodedAnswers(rt, sb, ct), EncodedImages(im)
        # The services (the plain path) and the encoded answers the polled RPCs are served from.
        self.runtime, self.sandboxes, self.containers, self.images = rt, sb, ct, im
        self.checkpoints = cp
        self.answers, self.image_answers = fast, fast_images
        self.runtime_rpcs = [
            Rpc("Version", pb.VersionRequest, fast.version, True),
            Rpc("Status", pb.StatusRequest, rt.status, True),
            Rpc("RuntimeConfig", pb.RuntimeConfigRequest, rt.runtime_config, True),
            Rpc("UpdateRuntimeConfig", pb.UpdateRuntimeConfigRequest, rt.update_runtime_config, False),
            Rpc("RunPodSandbox", pb.RunPodSandboxRequest, sb.run, False),
            Rpc("StopPodSandbox", pb.StopPodSandboxRequest, sb.stop, False),
            Rpc("RemovePodSandbox", pb.RemovePodSandboxRequest, sb.remove, False),
            Rpc("PodSandboxStatus", pb.PodSandboxStatusRequest, fast.pod_sandbox_status, True),
            Rpc("ListPodSandbox", pb.ListPodSandboxRequest, fast.list_pod_sandbox, True),
            Rpc("PodSandboxStats", pb.PodSandboxStatsRequest, sb.stats, True),
            Rpc("ListPodSandboxStats", pb.ListPodSandboxStatsRequest, sb.list_stats, True),
            Rpc("ListMetricDescriptors", pb.ListMetricDescriptorsRequest, sb.metric_descriptors, True),
            Rpc("ListPodSandboxMetrics", pb.ListPodSandboxMetricsRequest, sb.metrics, True),
            Rpc("UpdatePodSandboxResources", pb.UpdatePodSandboxResourcesRequest, sb.update_resources, False),
            Rpc("CreateContainer", pb.CreateContainerRequest, ct.create, False),
            Rpc("StartContainer", pb.StartContainerRequest, ct.start, False),
            Rpc("StopContainer", pb.StopContainerRequest, ct.stop, False),
            Rpc("RemoveContainer", pb.RemoveContainerRequest, ct.remove, False),
            Rpc("ContainerStatus", pb.ContainerStatusRequest, fast.container_status, True),
            Rpc("ListContainers", pb.ListContainersRequest, fast.list_containers, True),
            Rpc("UpdateContainerResources", pb.UpdateContainerResourcesRequest, ct.update_resources, False),
            Rpc("ReopenContainerLog", pb.ReopenContainerLogRequest, ct.reopen_log, False),
            Rpc("ExecSync", pb.ExecSyncRequest, ct.exec_sync, False),
            Rpc("Exec", pb.ExecRequest, ct.exec, False),
            Rpc("Attach", pb.AttachRequest, ct.attach, False),
            Rpc("PortForward", pb.PortForwardRequest, ct.port_forward, False),
            Rpc("ContainerStats", pb.ContainerStatsRequest, ct.stats, True),
            Rpc("ListContainerStats", pb.ListContainerStatsRequest, ct.list_stats, True),
            Rpc("CheckpointContainer", pb.CheckpointContainerRequest, cp.checkpoint_container, False),
            Rpc("CheckpointPod", pb.CheckpointPodRequest, cp.checkpoint_pod, False),
            Rpc("RestorePod", pb.RestorePodRequest, cp.restore_pod, False),
            Rpc("GetContainerEvents", pb.GetEventsRequest, self._container_events, True, stream=True),
            # Stream* twins: the entries of their List with the same filter, in chunks.
            Rpc(
                "StreamPodSandboxes", pb.ListPodSandboxRequest, _chunked(fast.pod_sandbox_entries), True, True
            ),
            Rpc("StreamContainers", pb.ListContainersRequest, _chunked(fast.container_entries), True, True),
            Rpc(
                "StreamContainerStats",
                pb.ListContainerStatsRequest,
                _chunked(_entries_of(ct.list_stats)),
                True,
                True,
            ),
            Rpc(
                "StreamPodSandboxStats",
                pb.ListPodSandboxStatsRequest,
                _chunked(_entries_of(sb.list_stats)),
                True,
                True,
            ),
            Rpc(
                "StreamPodSandboxMetrics",
                pb.ListPodSandboxMetricsRequest,
                _chunked(_entries_of(sb.metrics)),
                True,
                True,
            ),
        ]
        self.image_rpcs = [
            Rpc("PullImage", pb.PullImageRequest, im.pull, False),
            Rpc("ListImages", pb.ListImagesRequest, fast_images.list_images, True),
            Rpc("ImageStatus", pb.ImageStatusRequest, im.status, True),
            Rpc("RemoveImage", pb.RemoveImageRequest, im.remove, False),
            Rpc("ImageFsInfo", pb.ImageFsInfoRequest, fast_images.image_fs_info, True),
            Rpc("StreamImages", pb.ListImagesRequest, _chunked(_entries_of(im.list_)), True, True),
        ]

    # ------------------------------------------------------------------ calls
    @contextlib.contextmanager
    def _outcome(self, rpc: Rpc, req: Message | Undecodable) -> Iterator[Outcome]:
        """Runs one call: maps its condition to a code (swallowing it) and logs it once."""
        out = Outcome()
        t0 = time.perf_counter()
        try:
            yield out
        except Exception as exc:
            out.code, out.detail, _ = self._settle(rpc, req, None, exc, t0)
        except BaseException as exc:  # cancelled, or the stream closed under it
            cancelled = exc if isinstance(exc, asyncio.CancelledError) else None
            self._settle(rpc, req, out.response, cancelled, t0)
            raise
        else:
            self._settle(rpc, req, out.response, None, t0)

    def begin(self, rpc: Rpc, req: Message | Undecodable) -> Settled | Awaitable[Settled]:
        """Starts one unary call: its (code, detail, response) at once, or an awaitable of them.

        Both transports call this (grpcio through its unary handler, the
        native one directly, so that a call answered without waiting needs
        no task). Every outcome is logged once, here.
        """
        t0 = time.perf_counter()
        try:
            if type(req) is Undecodable:  # _require_valid, inline: this runs on every call
                _require_valid(rpc, req)
            resp = rpc.fn(req)
        except Exception as exc:
            return self._settle(rpc, req, None, exc, t0)
        kind = type(resp)
        if kind not in _NOT_COROUTINES:
            if asyncio.iscoroutine(resp):
                return self._finish(rpc, req, resp, t0)
            _NOT_COROUTINES.add(kind)
        if rpc.polled and self.observer is None and not debug_enabled():
            # A polled call answered: nothing to log or observe (_settle would only say OK).
            return _OK, "", resp
        return self._settle(rpc, req, resp, None, t0)

    async def _finish(
        self, rpc: Rpc, req: Message | Undecodable, pending: Awaitable[Any], t0: float
    ) -> Settled:
        try:
            resp = await pending
        except asyncio.CancelledError as exc:
            self._settle(rpc, req, None, exc, t0)
            raise
        except Exception as exc:
            return self._settle(rpc, req, None, exc, t0)
        return self._settle(rpc, req, resp, None, t0)

    def _settle(
        self, rpc: Rpc, req: Message | Undecodable, resp: Any, exc: BaseException | None, t0: float
    ) -> Settled:
        """The call's code and detail from how it ended (called inside the ``except`` that caught ``exc``)."""
        code, detail = _OK, ""
        if exc is None:  # the usual case, first: two isinstance() of None were ~0.15 us
            pass
        elif isinstance(exc, CriError):
            code, detail = status_code(exc), exc.message
        elif isinstance(exc, asyncio.CancelledError):
            code = Code.CANCELLED
        elif exc is not None:
            code = Code.UNKNOWN
            detail = f"{rpc.name} failed: {type(exc).__name__}: {exc}"
            log.exception("rpc.bug", method=rpc.name)
        self._log(rpc, req, resp, code, detail, time.perf_counter() - t0)
        return code, detail, resp

    def stream_handler(self, rpc: Rpc) -> StreamHandler:
        """The server-streaming call ``rpc``: an async generator of (request, context); both transports."""

        async def handle(req: Message | Undecodable, context: AbortContext) -> AsyncGenerator[Any, None]:
            with self._outcome(rpc, req) as out:
                _require_valid(rpc, req)
                async for item in rpc.fn(req):
                    yield item
            if out.code != Code.OK:
                await context.abort(out.code, out.detail)

        return handle

    async def _container_events(self, req: pb.GetEventsRequest) -> AsyncIterator[pb.ContainerEventResponse]:
        async for event in self.shim.events.subscribe():
            yield event

    def _log(self, rpc: Rpc, req: Any, resp: Any, code: Code, detail: str, seconds: float) -> None:
        if self.observer is not None:
            self.observer(rpc.name, code.name, seconds)
        polled = rpc.polled and code == _OK
        if polled and not debug_enabled():
            return  # its line would be filtered out: do not build it
        logger = log.debug if polled else (log.info if code in _EXPECTED else log.warning)
        fields: dict[str, Any] = {"method": rpc.name, "code": code.name, "ms": round(seconds * 1000, 3)}
        if not isinstance(req, Undecodable) and req is not None:
            for f in _ID_FIELDS:
                v = getattr(req, f, None)
                if v:
                    fields[f] = v
        if resp is not None and not isinstance(resp, bytes):
            for f in _ID_FIELDS:
                v = getattr(resp, f, None)
                if v:
                    fields[f] = v
        if detail:
            fields["error"] = detail
        logger("rpc", **fields)


_EXPECTED = frozenset({Code.OK, Code.NOT_FOUND})
