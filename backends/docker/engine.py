"""The Docker Engine connection: HTTP/1.1 on the event loop, the SDK for the rare calls.

The calls on a pod's lifecycle path (create, start, stop, remove, inspect,
list, exec) are sent by :meth:`EngineClient.request` over a small pool of
kept-alive connections, on the event loop. Through ``docker.APIClient`` each
such call costs about 0.5 ms of requests/urllib3 work plus a worker-thread
hop, which is more than the whole CRI round trip costs the shim; the engine
itself answers an inspect in about 0.3 ms. Rare calls (an image removal, a resource
update) go through the SDK in a thread pool; it is imported at the first such
call. Long-lived streams (logs follow, events, pull progress, the hijacked
exec/attach connections) get a connection of their own each.

Every engine error is translated into a :mod:`backends.contract.errors`
condition here, once. The typed operations of :class:`.engine_api.EngineAPI`
are thin methods over :meth:`EngineClient.request` and :meth:`EngineClient.stream`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import json
import os
import sys
import time
import urllib.parse
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from backends.contract.errors import (
    AlreadyExistsError,
    CriError,
    DeadlineExceededError,
    FailedPreconditionError,
    InternalError,
    InvalidArgumentError,
    NotFoundError,
    UnavailableError,
)
from backends.docker.http1 import RawResponse, message_of, parse_head, read_chunked

if TYPE_CHECKING:
    import docker
    import docker.errors

API_VERSION = "1.41"  # Docker 20.10; newer engines still accept it
T = TypeVar("T")


def translate(exc: BaseException) -> CriError:
    """One engine/transport error as the CRI condition it means."""
    if isinstance(exc, CriError):
        return exc
    if "docker.errors" in sys.modules:  # else no SDK call ran: the error cannot be one of its
        sdk_error = _translate_sdk(exc)
        if sdk_error is not None:
            return sdk_error
    if isinstance(exc, TimeoutError):
        return DeadlineExceededError(f"docker engine did not answer in time: {exc}")
    if isinstance(exc, ConnectionError | FileNotFoundError | OSError):
        return UnavailableError(f"docker engine unreachable: {exc}")
    return InternalError(f"{type(exc).__name__}: {exc}")


def _translate_sdk(exc: BaseException) -> CriError | None:
    """An error of the docker SDK (or of requests under it) as its CRI condition; None if not one."""
    import docker.errors
    import requests.exceptions

    if isinstance(exc, docker.errors.NotFound):
        return NotFoundError(_explain(exc))
    if isinstance(exc, docker.errors.APIError):
        return status_error(exc.status_code or 0, _explain(exc))
    if isinstance(exc, requests.exceptions.Timeout):
        return DeadlineExceededError(f"docker engine did not answer in time: {exc}")
    if isinstance(exc, requests.exceptions.ConnectionError):
        return UnavailableError(f"docker engine unreachable: {exc}")
    if isinstance(exc, docker.errors.DockerException):
        return InternalError(str(exc))
    return None


def status_error(status: int, message: str) -> CriError:
    """The CRI condition an engine error status means."""
    if status == 404:
        return NotFoundError(message)
    if status == 409:
        if "already in use" in message:
            return AlreadyExistsError(message)
        return FailedPreconditionError(message)
    if status == 503:
        return UnavailableError(message)
    if 400 <= status < 500:
        # 400, and the rarer 414/431 of a reference too long for a URL: the request's fault.
        return InvalidArgumentError(message)
    return InternalError(message)


def _explain(exc: docker.errors.APIError) -> str:
    return str(exc.explanation or exc)


def _query_value(value: Any) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, dict | list):
        return json.dumps(value, separators=(",", ":"))
    return str(value)


def request_target(path: str, query: dict[str, Any] | None) -> str:
    """The request target of an engine path: versioned, with the query encoded."""
    target = f"/v{API_VERSION}{path}"
    if query:
        pairs = {k: _query_value(v) for k, v in query.items() if v is not None}
        if pairs:
            target += "?" + urllib.parse.urlencode(pairs, quote_via=urllib.parse.quote)
    return target


def quote_ref(ref: str) -> str:
    """An image reference or object name as one path segment of an engine URL."""
    return urllib.parse.quote(ref, safe=":@/")


class _Retry(Exception):
    """A kept-alive connection turned out closed before any answer: send again on a new one."""


_MAX_IDLE = 16  # kept-alive connections; more concurrent calls open more and close them after
# A kept-alive connection unused this long is closed: after a burst the client
# shrinks back to what the steady load needs (a quiet node holds none), so a
# long-running shim's descriptors follow its load, not its busiest moment.
_IDLE_AGE = 15.0


class EngineClient:
    """Async access to one Docker Engine endpoint."""

    def __init__(self, endpoint: str, call_timeout: float = 60.0, workers: int = 32) -> None:
        self.endpoint = endpoint
        self.call_timeout = call_timeout
        self._pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="docker-api")
        url = urllib.parse.urlsplit(endpoint)
        self._socket_path = url.path if url.scheme in ("unix", "http+unix") else ""
        self._workers = workers
        self._api: docker.APIClient | None = None  # the SDK's client, made at its first use
        # Kept-alive connections, the most recently used last, with when each was put back.
        self._idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter, float]] = []
        self._sweep: asyncio.TimerHandle | None = None
        self._closed = False
        # At most this many short calls in flight (the SDK's pool had as many
        # threads): a burst of kubelet calls must not become a burst of
        # hundreds of engine connections.
        self._slots = asyncio.Semaphore(workers)

    @property
    def api(self) -> docker.APIClient:
        """The docker SDK's client, for the rare calls (a resource update, an image removal).

        Imported and made at the first such call: the SDK and requests under it
        cost a shim that never makes one about 10 MiB of memory. Constructing it
        with a fixed version makes no request.
        """
        if self._api is None:
            import docker

            self._api = docker.APIClient(
                base_url=self.endpoint,
                version=API_VERSION,
                timeout=int(self.call_timeout),
                max_pool_size=self._workers,
            )
        return self._api

    # ---------------------------------------------------------------- short calls, on the loop

    async def request(
        self,
        method: str,
        path: str,
        query: dict[str, Any] | None = None,
        body: Any = None,
        deadline: float | None = None,
    ) -> Any:
        """One short engine call; its decoded JSON answer (raw bytes when not JSON, None when empty).

        Error statuses become CRI conditions (404 NOT_FOUND, 409 ALREADY_EXISTS
        or FAILED_PRECONDITION, 400 INVALID_ARGUMENT, ...); 304 (already
        started/stopped) is success, as in the SDK. A call not answered within
        ``deadline`` (default: the call timeout) is DEADLINE_EXCEEDED, and its
        connection is dropped.
        """
        payload = b"" if body is None else json.dumps(body, separators=(",", ":")).encode()
        lines = [f"{method} {request_target(path, query)} HTTP/1.1", "Host: docker"]
        if payload or method in ("POST", "PUT"):
            lines += ["Content-Type: application/json", f"Content-Length: {len(payload)}"]
        head = ("\r\n".join(lines) + "\r\n\r\n").encode() + payload
        limit = deadline or self.call_timeout
        try:
            async with asyncio.timeout(limit), self._slots:
                try:
                    status, headers, data = await self._exchange(head, reuse=True)
                except _Retry:
                    status, headers, data = await self._exchange(head, reuse=False)
        except TimeoutError as exc:
            raise DeadlineExceededError(
                f"docker engine did not answer {method} {path} within {limit:.0f}s"
            ) from exc
        is_json = "json" in headers.get("content-type", "")
        if 300 <= status < 400 and status != 304:
            # The engine's router redirects paths it cleans ("//", ".."): a
            # malformed name or reference in the path.
            raise InvalidArgumentError(f"docker engine refused the path of {method} {path!r}")
        if status >= 400:
            message = data.decode("utf-8", "replace").strip()
            if is_json:
                with contextlib.suppress(ValueError, AttributeError):
                    message = str(json.loads(data).get("message") or message)
            raise status_error(status, message or f"docker engine answered {status} to {method} {path}")
        if not data:
            return None
        if is_json:
            try:
                return json.loads(data)
            except ValueError as exc:
                raise InternalError(f"docker engine sent malformed JSON for {method} {path}") from exc
        return data

    async def _exchange(self, head: bytes, reuse: bool) -> tuple[int, dict[str, str], bytes]:
        conn = self._idle.pop()[:2] if reuse and self._idle else None
        reused = conn is not None
        if conn is None:
            conn = await self._connect()
        reader, writer = conn
        keep = False
        try:
            writer.write(head)
            try:
                raw_head = await reader.readuntil(b"\r\n\r\n")
            except asyncio.IncompleteReadError as exc:
                if reused and not exc.partial:
                    raise _Retry from exc
                raise
            status, headers = parse_head(raw_head)
            if status in (204, 304) or 100 <= status < 200:
                data = b""
            elif "chunked" in headers.get("transfer-encoding", "").lower():
                data = await read_chunked(reader)
            elif "content-length" in headers:
                data = await reader.readexactly(int(headers["content-length"]))
            else:
                data = await reader.read()  # delimited by the end of the connection
                headers["connection"] = "close"
            keep = "close" not in headers.get("connection", "").lower()
            return status, headers, data
        except (ConnectionError, BrokenPipeError) as exc:
            if reused:
                raise _Retry from exc
            raise UnavailableError(f"docker engine connection lost: {exc}") from exc
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError) as exc:
            raise UnavailableError(f"docker engine connection lost: {exc!r}") from exc
        finally:
            if keep and not self._closed and len(self._idle) < _MAX_IDLE:
                self._idle.append((reader, writer, time.monotonic()))
                if self._sweep is None:
                    self._sweep = asyncio.get_running_loop().call_later(_IDLE_AGE, self._retire_idle)
            else:
                writer.close()

    def _retire_idle(self) -> None:
        """Close the kept-alive connections unused for _IDLE_AGE; look again when the next one is due."""
        self._sweep = None
        cutoff = time.monotonic() - _IDLE_AGE
        # The list is in the order connections were put back: the stale ones lead.
        stale = 0
        while stale < len(self._idle) and self._idle[stale][2] <= cutoff:
            self._idle[stale][1].close()
            stale += 1
        del self._idle[:stale]
        if self._idle and not self._closed:
            due = self._idle[0][2] + _IDLE_AGE - time.monotonic()
            self._sweep = asyncio.get_running_loop().call_later(max(due, 0.05), self._retire_idle)

    async def call(self, fn: Callable[..., T], *args: Any, deadline: float | None = None, **kwargs: Any) -> T:
        """Run a blocking SDK call in the pool; engine errors become CRI conditions."""
        loop = asyncio.get_running_loop()
        fut = loop.run_in_executor(self._pool, functools.partial(self._guarded, fn, *args, **kwargs))
        try:
            async with asyncio.timeout(deadline or self.call_timeout + 5):
                return await fut
        except TimeoutError as exc:
            raise DeadlineExceededError(
                f"docker engine call {getattr(fn, '__name__', fn)} timed out"
            ) from exc
        except CriError:
            raise
        except Exception as exc:
            raise translate(exc) from exc

    def _guarded(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        # A stopped dockerd removes its socket. Checking first answers at once
        # and avoids the SDK's unix adapter, which leaks the socket of a
        # failed connect.
        if self._socket_path and not os.path.exists(self._socket_path):
            raise UnavailableError(f"docker engine socket {self._socket_path} does not exist")
        return fn(*args, **kwargs)

    async def run(self, fn: Callable[[], T]) -> T:
        """Run an arbitrary blocking function in the pool (no engine translation)."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn)

    async def close(self) -> None:
        self._closed = True
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None
        idle, self._idle = self._idle, []
        for _reader, writer, _since in idle:
            writer.close()
        for _reader, writer, _since in idle:
            with contextlib.suppress(OSError):
                await writer.wait_closed()
        if self._api is not None:
            self._api.close()
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ---------------------------------------------------------------- typed operations (EngineAPI)

    async def ping(self, deadline: float | None = None) -> None:
        await self.request("GET", "/_ping", deadline=deadline)

    async def info(self, deadline: float | None = None) -> dict[str, Any]:
        result: dict[str, Any] = await self.request("GET", "/info", deadline=deadline)
        return result

    async def df(self) -> dict[str, Any]:
        result: dict[str, Any] = await self.request("GET", "/system/df", deadline=120)
        return result

    async def events(self, filters: dict[str, list[str]], since: str | None) -> RawResponse:
        query: dict[str, Any] = {"filters": json.dumps(filters)}
        if since is not None:
            query["since"] = since
        return await self.stream("GET", "/events", query=query)

    async def create_container(self, name: str, config: dict[str, Any]) -> str:
        created = await self.request("POST", "/containers/create", {"name": name}, config)
        return str(created["Id"])

    async def start_container(self, engine_id: str) -> None:
        await self.request("POST", f"/containers/{engine_id}/start")

    async def stop_container(self, engine_id: str, timeout: int) -> None:
        # The SDK waits timeout + its own call timeout for the answer; so do we.
        timeout = max(0, timeout)
        await self.request(
            "POST", f"/containers/{engine_id}/stop", {"t": timeout}, deadline=timeout + self.call_timeout
        )

    async def remove_container(self, engine_id: str, force: bool = False) -> None:
        await self.request("DELETE", f"/containers/{engine_id}", {"v": True, "force": force or None})

    async def rename_container(self, engine_id: str, name: str) -> None:
        await self.request("POST", f"/containers/{engine_id}/rename", {"name": name})

    async def inspect_container(self, engine_id: str) -> dict[str, Any]:
        result: dict[str, Any] = await self.request("GET", f"/containers/{engine_id}/json")
        return result

    async def list_containers(self, filters: dict[str, list[str]]) -> list[dict[str, Any]]:
        rows: list[dict[str, Any]] = await self.request(
            "GET", "/containers/json", {"all": True, "filters": filters}
        )
        return rows

    async def update_container(self, engine_id: str, resources: dict[str, Any]) -> None:
        await self.call(
            self.api.update_container,
            engine_id,
            cpu_period=resources.get("CpuPeriod") or None,
            cpu_quota=resources.get("CpuQuota") or None,
            cpu_shares=resources.get("CpuShares") or None,
            mem_limit=resources.get("Memory") or None,
            memswap_limit=resources.get("MemorySwap") or None,
            cpuset_cpus=resources.get("CpusetCpus") or None,
            cpuset_mems=resources.get("CpusetMems") or None,
        )

    async def resize_container(self, engine_id: str, height: int, width: int) -> None:
        await self.request("POST", f"/containers/{engine_id}/resize", {"h": height, "w": width})

    async def attach_container(self, engine_id: str, stdin: bool, stdout: bool, stderr: bool) -> RawResponse:
        query = {"stream": 1, "stdin": int(stdin), "stdout": int(stdout), "stderr": int(stderr), "logs": 0}
        return await self.stream("POST", f"/containers/{engine_id}/attach", query=query, upgrade=True)

    async def container_logs(
        self, engine_id: str, follow: bool, timestamps: bool, since: str | None
    ) -> RawResponse:
        query: dict[str, Any] = {
            "follow": int(follow),
            "stdout": 1,
            "stderr": 1,
            "timestamps": int(timestamps),
        }
        if since is not None:
            query["since"] = since
        return await self.stream("GET", f"/containers/{engine_id}/logs", query=query)

    async def exec_create(self, engine_id: str, cmd: list[str], stdin: bool, tty: bool, stderr: bool) -> str:
        body = {
            "AttachStdin": stdin,
            "AttachStdout": True,
            "AttachStderr": stderr,
            "Tty": tty,
            "Cmd": cmd,
            "Privileged": False,
        }
        created = await self.request("POST", f"/containers/{engine_id}/exec", body=body)
        return str(created["Id"])

    async def exec_start(self, exec_id: str, tty: bool) -> RawResponse:
        return await self.stream(
            "POST", f"/exec/{exec_id}/start", body={"Detach": False, "Tty": tty}, upgrade=True
        )

    async def exec_inspect(self, exec_id: str) -> dict[str, Any]:
        result: dict[str, Any] = await self.request("GET", f"/exec/{exec_id}/json")
        return result

    async def exec_resize(self, exec_id: str, height: int, width: int) -> None:
        await self.request("POST", f"/exec/{exec_id}/resize", {"h": height, "w": width})

    async def image_inspect(self, ref: str) -> dict[str, Any]:
        result: dict[str, Any] = await self.request("GET", f"/images/{quote_ref(ref)}/json")
        return result

    async def image_list(self) -> list[dict[str, Any]]:
        rows: list[dict[str, Any]] = await self.request("GET", "/images/json") or []
        return rows

    async def image_pull(
        self, image: str, tag: str, auth: str | None, answer_timeout: float | None
    ) -> RawResponse:
        return await self.stream(
            "POST",
            "/images/create",
            query={"fromImage": image, "tag": tag or None},
            headers={"X-Registry-Auth": auth} if auth else {},
            answer_timeout=answer_timeout,
        )

    async def image_remove(self, image_id: str, force: bool = True) -> None:
        await self.call(self.api.remove_image, image_id, force=force)

    # ---------------------------------------------------------------- raw HTTP

    async def _connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        url = urllib.parse.urlsplit(self.endpoint)
        try:
            if url.scheme in ("unix", "http+unix", ""):
                return await asyncio.open_unix_connection(url.path or self.endpoint, limit=1 << 20)
            if url.scheme in ("tcp", "http"):
                return await asyncio.open_connection(url.hostname, url.port or 2375, limit=1 << 20)
        except OSError as exc:
            raise UnavailableError(f"docker engine unreachable: {exc}") from exc
        raise InvalidArgumentError(f"unsupported docker endpoint {self.endpoint!r}")

    async def stream(
        self,
        method: str,
        path: str,
        query: dict[str, Any] | None = None,
        body: Any = None,
        headers: dict[str, str] | None = None,
        upgrade: bool = False,
        connect_timeout: float = 10.0,
        answer_timeout: float | None = 10.0,
    ) -> RawResponse:
        """Send one request on a fresh connection and return the open response.

        With ``upgrade`` the connection is hijacked (exec/attach): after the
        101 answer it carries the raw, bidirectional stream. The engine must
        answer within ``answer_timeout`` seconds (None: no limit), else
        DEADLINE_EXCEEDED.
        """
        # asyncio.timeout, not wait_for: on Python 3.11 wait_for can swallow a
        # cancellation that lands as the inner await completes, and a cancelled
        # event watcher would then block on its stream for good.
        async with asyncio.timeout(connect_timeout):
            reader, writer = await self._connect()
        try:
            target = request_target(path, query)
            payload = b"" if body is None else json.dumps(body).encode()
            lines = [f"{method} {target} HTTP/1.1", "Host: docker"]
            if payload or method == "POST":
                lines += ["Content-Type: application/json", f"Content-Length: {len(payload)}"]
            if upgrade:
                lines += ["Connection: Upgrade", "Upgrade: tcp"]
            lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
            writer.write(("\r\n".join(lines) + "\r\n\r\n").encode() + payload)
            await writer.drain()
            try:
                async with asyncio.timeout(answer_timeout):
                    head = await reader.readuntil(b"\r\n\r\n")
            except TimeoutError as exc:
                raise DeadlineExceededError(
                    f"docker engine sent no answer to {path} within {answer_timeout:.0f}s"
                ) from exc
            status, resp_headers = parse_head(head)
            resp = RawResponse(status, resp_headers, reader, writer, raw=upgrade and status == 101)
            if status >= 400:
                text = (await resp.read_all(limit=64 * 1024)).decode("utf-8", "replace")
                resp.close()
                raise status_error(status, message_of(text))
            return resp
        except (OSError, asyncio.IncompleteReadError, TimeoutError, ValueError, IndexError) as exc:
            writer.close()
            raise UnavailableError(f"docker engine stream {path}: {exc!r}") from exc
        except BaseException:
            writer.close()
            raise
