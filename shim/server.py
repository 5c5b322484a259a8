"""The server's life: startup → recover → serve → graceful shutdown.

Startup builds the backends, loads the persisted records, reconciles them
with what each backend really has, starts the streaming server, and only
then opens the CRI socket (and tells systemd READY=1), so that no client
sees a half-recovered shim.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import gc
import grp
import os
import signal
import socket
import stat
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import structlog

from backends.contract import Backend
from backends.registry import HandlerRegistry, create_backend
from shim.config import Config
from shim.cri.errors import CriError, UnimplementedError
from shim.cri.recovery import recover
from shim.cri.servicer import CriServicer, RpcObserver
from shim.cri.state import Shim
from shim.cri.store import StateDir, Store, new_id
from shim.cri.streaming_runtime import StreamTarget
from shim.transport.native import NativeServer, listen_socket

if TYPE_CHECKING:
    from shim.transport.grpcio import GrpcioServer

log = structlog.get_logger("server")


class ServerError(Exception):
    """Startup cannot proceed; the message says why."""


def parse_listen(listen: str) -> tuple[str, str]:
    """("unix", path) or ("fd", "") from unix:///path, /path or fd://."""
    if listen.startswith("fd://"):
        return "fd", listen[len("fd://") :]
    if listen.startswith("unix://"):
        path = listen[len("unix://") :]
    elif listen.startswith("/"):
        path = listen
    else:
        raise ServerError(f"--listen {listen!r}: expected unix:///path/to.sock or fd://")
    if not path.startswith("/"):
        raise ServerError(f"--listen {listen!r}: the socket path must be absolute")
    if len(path.encode()) > 107:
        raise ServerError(f"--listen {listen!r}: a unix socket path is limited to 107 bytes")
    return "unix", path


def prepare_socket_path(path: str) -> None:
    """Create parent folders; replace a stale socket; refuse one that a live server holds."""
    os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise ServerError(f"{path} exists and is not a socket; refusing to replace it")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(path)
    except OSError as exc:
        if exc.errno in (errno.ECONNREFUSED, errno.ENOENT):
            os.unlink(path)  # nobody listens: a leftover of a killed server
            return
        raise ServerError(f"cannot probe the existing socket {path}: {exc}") from None
    finally:
        probe.close()
    raise ServerError(f"another server is listening on {path}; stop it first or choose another --listen")


def systemd_fds() -> list[int]:
    """The sockets systemd passed us (LISTEN_FDS), per sd_listen_fds(3)."""
    if os.environ.get("LISTEN_PID") not in (None, str(os.getpid())):
        return []
    try:
        n = int(os.environ.get("LISTEN_FDS", "0"))
    except ValueError:
        return []
    for var in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"):
        os.environ.pop(var, None)
    return list(range(3, 3 + n))


SYSTEMD_RUNTIME_DIR = "/run/systemd/system"  # what sd_booted(3) looks for


def check_cgroup_driver(drivers: Mapping[str, str]) -> None:
    """Refuse "systemd" (``drivers``: where it is set -> the driver) on a host that did not boot
    with systemd: RuntimeConfig would make the kubelet use its systemd cgroup manager, which
    talks to systemd, and hand out slice names no cgroupfs runtime nests correctly."""
    asked = [where for where, driver in drivers.items() if driver == "systemd"]
    if not asked or os.path.isdir(SYSTEMD_RUNTIME_DIR):
        return
    try:
        with open("/proc/1/comm") as fh:
            init = fh.read().strip()
    except OSError:
        init = "unknown"
    raise ServerError(
        f'{", ".join(asked)}: cgroup_driver "systemd" needs systemd as the init system, and this '
        f"host has none (PID 1 is {init!r}; {SYSTEMD_RUNTIME_DIR} is missing): the kubelet, which "
        'takes its cgroup driver from RuntimeConfig, could not make its cgroups; use "cgroupfs"'
    )


def sd_notify(message: str) -> None:
    addr = os.environ.get("NOTIFY_SOCKET")
    if not addr:
        return
    if addr.startswith("@"):
        addr = "\0" + addr[1:]
    with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.sendto(message.encode(), addr)


class Server:
    def __init__(
        self,
        config: Config,
        *,
        backends: Mapping[str, Backend] | None = None,
        clock: Callable[[], int] | None = None,
        id_factory: Callable[[], str] | None = None,
        observer: RpcObserver | None = None,
        wrap_backend: Callable[[Backend], Backend] | None = None,
        notify: bool = True,
    ) -> None:
        self.config = config
        self._notify = notify  # tell systemd READY=1 (a hollow process says it once, for all nodes)
        self._given_backends = backends
        self._clock = clock
        self._id_factory = id_factory
        self._observer = observer
        self.wrap_backend = wrap_backend
        self.shim: Shim | None = None
        self.grpc: GrpcioServer | None = None
        self.native: NativeServer | None = None
        self.streaming: Any = None
        self.socket_path = ""
        self._proxy: asyncio.Server | None = None
        self._stopped = asyncio.Event()

    def _build_backends(self) -> dict[str, Backend]:
        if self._given_backends is not None:
            return dict(self._given_backends)
        out = {}
        cni = self.config.cni
        cni_table = {
            "conf_dir": cni.conf_dir,
            "bin_dirs": list(cni.bin_dirs),
            "cache_dir": cni.cache_dir or os.path.join(self.config.server.state_dir, "cni"),
            "conf_template": cni.conf_template,
            "plugin_timeout": cni.plugin_timeout,
        }
        images = self.config.images.handler_options()
        for name, h in self.config.handlers.items():
            opts = dict(h.options)
            opts.setdefault("state_dir", os.path.join(self.config.server.state_dir, "backends", name))
            if "pull_no_progress_timeout" in opts:  # a handler's own value, by the key's old name
                log.warning(
                    "config.deprecated",
                    notice=f"[handlers.{name}] pull_no_progress_timeout is deprecated: it is read as "
                    "image_pull_progress_timeout; rename it",
                )
                opts.setdefault("image_pull_progress_timeout", opts.pop("pull_no_progress_timeout"))
            for key, value in images.items():  # a handler's table may set its own
                opts.setdefault(key, value)
            opts.setdefault("cgroup_driver", self.config.server.cgroup_driver)
            opts.setdefault("cni", cni_table)
            try:
                out[name] = create_backend(h.type, name, opts)
            except (CriError, ValueError, TypeError) as exc:
                # A backend checks its own options: say which table, never a traceback.
                raise ServerError(f"configuration error in [handlers.{name}]: {exc}") from None
        return out

    async def start(self) -> None:
        cfg = self.config.server
        for notice in self.config.notices:
            log.warning("config.deprecated", notice=notice)
        check_cgroup_driver(
            {"[server] cgroup_driver": self.config.server.cgroup_driver}
            | {
                f"[handlers.{n}] cgroup_driver": str(h.options["cgroup_driver"])
                for n, h in self.config.handlers.items()
                if "cgroup_driver" in h.options
            }
        )
        kind, path = parse_listen(cfg.listen)
        fds: list[int] = []
        if kind == "unix":
            prepare_socket_path(path)
        else:
            fds = systemd_fds()
            if len(fds) != 1:
                raise ServerError(
                    f"--listen fd:// needs exactly one socket from systemd (LISTEN_FDS), got {len(fds)}"
                )
        try:
            state = StateDir(cfg.state_dir)
        except OSError as exc:
            raise ServerError(f"cannot use state directory {cfg.state_dir}: {exc.strerror}") from None
        store = Store(state)
        store.load()
        backends = self._build_backends()
        if self.wrap_backend is not None:
            backends = {name: self.wrap_backend(b) for name, b in backends.items()}
        registry = HandlerRegistry(backends, cfg.default_handler)
        shim = Shim(
            self.config,
            registry,
            store,
            **({"clock": self._clock} if self._clock else {}),
            id_factory=self._id_factory or new_id,
        )
        shim.pod_cidr = state.load_runtime().get("pod_cidr", "")
        shim.hand_pod_cidr()
        self.shim = shim
        for name, backend in registry.items():
            try:
                await backend.lifecycle.start(shim)
            except Exception as exc:
                # A runtime that is down at boot is reported by Status and
                # recovers later; the shim itself must come up.
                log.error("backend.start_failed", handler=name, error=str(exc))
        await recover(shim)
        await self._start_streaming(shim)
        if self.config.nri.enable:
            await shim.nri.start()

        servicer = CriServicer(shim, observer=self._observer)
        if cfg.transport == "native":
            await self._start_native(servicer, kind, path, fds)
        else:
            await self._start_grpcio(servicer, kind, path, fds)
        log.info(
            "server.ready",
            listen=cfg.listen,
            handlers=registry.names(),
            default_handler=registry.default,
            sandboxes=len(store.sandboxes),
            containers=len(store.containers),
            event_loop=type(asyncio.get_running_loop()).__module__.split(".")[0],
            transport=cfg.transport,
        )
        # Records loaded at start live as long as the process: move them out of
        # the collector's sight. With tens of thousands of records, full
        # collections otherwise stall the loop for many ms. Young collections
        # stay small: their pause grows with the young generation (about 0.5-1 us
        # an object here; 20,000 gave 10-16 ms pauses every few seconds under
        # polling, most of it grpcio's per-call reference cycles), while full
        # ones come no more often than before (20 x 50 young collections apart).
        gc.collect()
        gc.freeze()
        gc.set_threshold(3_000, 20, 50)
        if self._notify:
            sd_notify("READY=1")

    async def _start_grpcio(self, servicer: CriServicer, kind: str, path: str, fds: list[int]) -> None:
        # Imported here only: grpc costs about 21 MiB of memory, which the native transport does without.
        from shim.transport.grpcio import GrpcioServer, relay_from_fd

        cfg = self.config.server
        server = GrpcioServer(servicer, cfg.max_message_bytes)
        if kind == "unix":
            bind_path = path
        else:
            bind_path = os.path.join(cfg.state_dir, "grpc.sock")
            prepare_socket_path(bind_path)
        if not await server.start(bind_path):
            raise ServerError(f"cannot listen on {bind_path}")
        self.grpc = server
        if kind == "unix":
            self.socket_path = path  # removed by stop() even if securing it fails
            self._secure_socket(bind_path)
        else:
            os.chmod(bind_path, 0o600)
            self._proxy = await relay_from_fd(fds[0], bind_path)
            self.socket_path = bind_path
        await server.set_serving()

    async def _start_native(self, servicer: CriServicer, kind: str, path: str, fds: list[int]) -> None:
        """The native transport listens on the socket itself, systemd's one too."""
        native = NativeServer(servicer, self.config.server.max_message_bytes)
        if kind == "unix":
            self.socket_path = path  # removed by stop() even if securing it fails
            sock = listen_socket(path)
            try:
                self._secure_socket(path)
            except BaseException:
                sock.close()
                raise
        else:
            sock = socket.socket(fileno=fds[0])
            sock.setblocking(False)
        await native.start(sock=sock)
        self.native = native

    def _secure_socket(self, path: str) -> None:
        cfg = self.config.server
        os.chmod(path, cfg.socket_mode)
        if cfg.socket_group:
            try:
                gid = grp.getgrnam(cfg.socket_group).gr_gid
            except KeyError:
                raise ServerError(f"[server] socket_group: no group named {cfg.socket_group!r}") from None
            os.chown(path, -1, gid)

    async def _start_streaming(self, shim: Shim) -> None:
        try:
            from shim import streaming  # type: ignore[attr-defined, unused-ignore]
        except ImportError:
            log.warning("streaming.unavailable")
            return
        s = self.config.streaming
        conf = streaming.StreamingConfig(
            address=s.address,
            port=s.port,
            tls_cert=s.tls_cert,
            tls_key=s.tls_key,
            token_ttl=s.token_ttl,
            idle_timeout=s.idle_timeout,
            max_streams=s.max_streams,
        )
        self.streaming = streaming.StreamingServer(StreamTarget(shim), conf)
        await self.streaming.start()
        shim.streaming = self.streaming

    async def stop(self, grace: float | None = None) -> None:
        if grace is None:
            grace = self.config.server.shutdown_grace
        if self._proxy is not None:
            self._proxy.close()
        if self.grpc is not None:
            await self.grpc.stop(grace)
        if self.native is not None:
            await self.native.stop(grace)
        if self.streaming is not None:
            with contextlib.suppress(Exception):
                await self.streaming.stop()
        if self.shim is not None:
            await self.shim.nri.stop()
            await self.shim.io.aclose()  # before the backends whose processes it reads
            if not self.shim.store.retry_unsaved():
                log.error("state.unsaved_at_exit", ids=sorted(self.shim.store.unsaved_ids()))
            self.shim.store.close()
            for _, backend in self.shim.registry.items():
                try:
                    await backend.lifecycle.close()
                except Exception as exc:
                    log.error("backend.close_failed", handler=backend.name, error=str(exc))
        if self.socket_path and self.config.server.listen.startswith(("unix://", "/")):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.socket_path)
        self._stopped.set()
        log.info("server.stopped")

    async def run_until_signalled(self) -> None:
        stop = stop_signals()
        await self.start()
        await stop.wait()
        log.info("server.stopping")
        sd_notify("STOPPING=1")
        await self.stop()


def stop_signals() -> asyncio.Event:
    """An event set by SIGTERM or SIGINT (SIGUSR1 dumps every task's stack to the log)."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGUSR1, dump_stacks)
    return stop


def dump_stacks() -> None:
    """SIGUSR1: every asyncio task's and thread's stack to the log."""
    import sys
    import traceback

    tasks = []
    for task in asyncio.all_tasks():
        frames = task.get_stack()
        tasks.append(
            {
                "task": task.get_name(),
                "stack": "".join(
                    traceback.format_list(traceback.extract_stack(frames[-1]) if frames else [])
                ),
            }
        )
    threads = {
        str(tid): "".join(traceback.format_stack(frame)) for tid, frame in sys._current_frames().items()
    }
    log.warning("diagnostics.stacks", tasks=tasks, threads=threads)


__all__ = ["Server", "ServerError", "UnimplementedError"]
