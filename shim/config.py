"""Configuration: TOML file → validated, frozen settings.

Sections: ``server``, ``handlers``, ``images``, ``streaming``, ``nri``, ``cni``, ``logging``.
Loading is two steps, as in uvicorn: parse, then validate every key; an
error names the section and the key (``ConfigError``). Command-line flags
override the file.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
from collections.abc import Mapping
from typing import Any

from backends.contract.errors import InvalidArgumentError
from backends.contract.pinning import PinnedImages
from backends.registry import BACKEND_MODULES

BACKEND_TYPES = tuple(BACKEND_MODULES)  # the registry's list, written once
DEFAULT_LISTEN = "unix:///run/cri-shim/cri-shim.sock"
DEFAULT_STATE_DIR = "/var/lib/cri-shim"
DEFAULT_CERTS_D = "/etc/cri-shim/certs.d"


class ConfigError(Exception):
    pass


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    listen: str = DEFAULT_LISTEN
    state_dir: str = DEFAULT_STATE_DIR
    default_handler: str = "fake"
    socket_mode: int = 0o660
    socket_group: str = ""
    max_message_bytes: int = 16 * 1024 * 1024
    cgroup_driver: str = "cgroupfs"
    metrics_listen: str = ""
    shutdown_grace: float = 10.0
    event_loop: str = "uvloop"
    transport: str = "native"


@dataclasses.dataclass(frozen=True)
class HandlerConfig:
    name: str
    type: str
    options: Mapping[str, Any]


@dataclasses.dataclass(frozen=True)
class ImagesConfig:
    pause_image: str = "registry.k8s.io/pause:3.10"
    # One directory per registry host with a hosts.toml (containerd's layout). The default is
    # used only if it exists; a directory named in the file must exist.
    config_path: str = DEFAULT_CERTS_D
    credentials_file: str = ""
    max_concurrent_downloads: int = 3
    image_pull_progress_timeout: float = 300.0
    pinned: tuple[str, ...] = ()

    def registry_config_path(self) -> str:
        """The hosts.toml directory the stores read, "" for none."""
        if self.config_path == DEFAULT_CERTS_D and not os.path.isdir(self.config_path):
            return ""
        return self.config_path

    def handler_options(self) -> dict[str, Any]:
        """The section as the options the shim gives every handler (backends.contract.options)."""
        return {
            "pause_image": self.pause_image,
            "registry_config_path": self.registry_config_path(),
            "credentials_file": self.credentials_file,
            "max_concurrent_downloads": self.max_concurrent_downloads,
            "image_pull_progress_timeout": self.image_pull_progress_timeout,
            "pinned": list(self.pinned),
        }


@dataclasses.dataclass(frozen=True)
class StreamingSettings:
    address: str = "127.0.0.1"
    port: int = 0
    tls_cert: str = ""
    tls_key: str = ""
    token_ttl: float = 60.0
    idle_timeout: float = 4 * 3600.0
    max_streams: int = 256


@dataclasses.dataclass(frozen=True)
class NriConfig:
    """The runtime side of NRI (shim/nri): plugins dial ``socket_path``."""

    enable: bool = True
    socket_path: str = "/var/run/nri/nri.sock"
    # Seconds a plugin has to register and to answer Configure and Synchronize, and
    # to answer each later request (NRI's own defaults).
    registration_timeout: float = 5.0
    request_timeout: float = 2.0


@dataclasses.dataclass(frozen=True)
class CniConfig:
    """The node's CNI network (backends/cni), for the handlers with ``pod_network = "cni"``."""

    conf_dir: str = "/etc/cni/net.d"
    bin_dirs: tuple[str, ...] = ("/opt/cni/bin", "/usr/lib/cni")
    cache_dir: str = ""  # "" = <server.state_dir>/cni
    conf_template: str = ""
    plugin_timeout: float = 30.0


@dataclasses.dataclass(frozen=True)
class LoggingConfig:
    level: str = "info"
    format: str = "console"


@dataclasses.dataclass(frozen=True)
class Config:
    server: ServerConfig = ServerConfig()
    handlers: Mapping[str, HandlerConfig] = dataclasses.field(
        default_factory=lambda: {"fake": HandlerConfig("fake", "fake", {})}
    )
    images: ImagesConfig = ImagesConfig()
    streaming: StreamingSettings = StreamingSettings()
    logging: LoggingConfig = LoggingConfig()
    nri: NriConfig = NriConfig()
    cni: CniConfig = CniConfig()
    # What the file says that still works but should change (a deprecated key), logged at start.
    notices: tuple[str, ...] = dataclasses.field(default=(), compare=False)

    def with_handler(self, name: str) -> Config:
        """Adds a handler named after a backend type (e.g. `docker`) with default options."""
        if name in self.handlers:
            return self
        if name not in BACKEND_TYPES:
            raise ConfigError(
                f"[handlers] no handler named {name!r} is configured (configured: "
                f"{', '.join(sorted(self.handlers)) or 'none'}; built-in types: {', '.join(BACKEND_TYPES)})"
            )
        handlers = dict(self.handlers)
        handlers[name] = HandlerConfig(name, name, {})
        return dataclasses.replace(self, handlers=handlers)


DEFAULT_TOML = """\
# cri-shim configuration. Every key is optional; shown here with its default.

[server]
# Where the CRI gRPC server listens: unix:///path or fd:// (systemd socket activation).
listen = "unix:///run/cri-shim/cri-shim.sock"
# Records of pods and containers, persisted atomically and recovered on start.
state_dir = "/var/lib/cri-shim"
# Runtime handler used when a RunPodSandbox request names none ("").
default_handler = "fake"
# Permissions and group of the socket file.
socket_mode = "0660"
socket_group = ""
# Largest gRPC message accepted or sent (the kubelet uses 16 MiB).
max_message_bytes = 16777216
# Reported by RuntimeConfig; the kubelet's cgroupDriver must match it.
cgroup_driver = "cgroupfs"
# host:port for the Prometheus /metrics endpoint; empty disables it.
metrics_listen = ""
# Seconds to finish in-flight RPCs on SIGTERM/SIGINT.
shutdown_grace = 10.0
# uvloop (about 10% less time per RPC; asyncio is used when uvloop is not
# installed) or asyncio.
event_loop = "uvloop"
# How the CRI socket is served: native (HTTP/2 on the event loop itself, no
# threads: a fraction of grpcio's CPU per call; the default) or grpcio (the
# grpcio library's server). Both serve every CRI RPC and grpc.health.v1 Check.
transport = "native"

# One table per runtime handler (RuntimeClass handler name). `type` is one
# of fake, docker, runv; the other keys are options of that backend.
[handlers.fake]
type = "fake"
# Latency injected per backend method, in seconds, e.g. { run_sandbox = 0.05 }.
# latency = {}
# Errors injected per backend method, first in first out, as "CODE: message".
# errors = { start_container = ["UNAVAILABLE: injected"] }
# Scripted programs by image name (see backends/fake/program.py).
# [handlers.fake.programs."busybox"]
# output = ["hello"]
# exit_code = 0
# exit_after = 1.0

# [handlers.docker]
# type = "docker"
# endpoint = "unix:///var/run/docker.sock"
# Pod networks: "builtin" (the engine network `network`) or "cni" (the node's
# CNI network, [cni] below: what a cluster's network add-on configures).
# pod_network = "builtin"
# network = "bridge"
# Warm pause containers for host-network pods (other pods start cold: the
# engine fixes a pod's hostname and ports at create); 0 = off.
# [handlers.docker.pool]
# size = 0
# refill_interval = 0.05
# max_cpu = 0.8

# [handlers.runv]
# type = "runv"
# driver = "stub"   # or "qemu"
# ISOLATION depends on the driver. "stub" (the default) runs a pod's "VM" as
# Linux namespaces and a cgroup on the host kernel, with no hypervisor: a pod is
# no more isolated than a runc container; do not give it untrusted workloads.
# "qemu" boots each pod as a QEMU virtual machine with its own kernel (KVM, or
# TCG emulation for testing when KVM does not work); build its guest first with
# scripts/runv-guest. Paths default per handler: /var/lib/cri-shim/NAME and
# /run/cri-shim/NAME.
# Mounts: host directories and files are shared into the VM; host mounts made
# later propagate in (HOST_TO_CONTAINER); BIDIRECTIONAL propagates back out on
# the stub only (qemu refuses it).
# [handlers.runv.qemu]
# guest_dir = "/var/lib/cri-shim/runv-guest"
# accel = "auto"   # "kvm", "tcg"

[images]
# The sandbox (pause) image of backends that run one; every store reports it
# pinned (the kubelet's image garbage collection leaves it).
pause_image = "registry.k8s.io/pause:3.10"
# Registry hosts, mirrors, CAs, client certificates and headers, as containerd
# reads them: one directory per registry host (e.g. certs.d/docker.io/) with a
# hosts.toml. Read by the runv and fake stores (the docker backend's engine has
# its own /etc/docker/certs.d and registry-mirrors). The default below is used
# only if it exists; a directory set here must exist. "" = none.
# config_path = "/etc/cri-shim/certs.d"
# A node-wide credentials file (registry host -> credentials) for pulls the
# kubelet sends no credentials for; "" = none.
credentials_file = ""
# Layers one pull downloads at once (runv's store).
max_concurrent_downloads = 3
# A pull that receives no byte for this many seconds is cancelled, whatever
# its total time; 0 = never. (The old name pull_no_progress_timeout is still
# read, with a notice in the log.)
image_pull_progress_timeout = 300.0
# Images reported pinned, besides the pause image: references (normalised:
# "busybox:1.36" is docker.io/library/busybox:1.36) or globs where * matches
# anything ("registry.k8s.io/*", "*pause*"), against repo tags and digests.
# A pinned image can still be removed by a client (crictl rmi).
pinned = []

[streaming]
# Address and port of the exec/attach/port-forward server (0 = a random port).
address = "127.0.0.1"
port = 0
tls_cert = ""
tls_key = ""
# Seconds a streaming URL stays valid unused, and an open session stays idle.
token_ttl = 60.0
idle_timeout = 14400.0
max_streams = 256

[nri]
# The Node Resource Interface: plugins that dial socket_path see every pod and
# container event and may adjust containers as they are created.
enable = true
socket_path = "/var/run/nri/nri.sock"
registration_timeout = 5.0
request_timeout = 2.0

[cni]
# The node's pod network, for the handlers with pod_network = "cni". The first
# *.conflist, *.conf or *.json of conf_dir (lexical order) is the network;
# it is read again when it changes, and Status says NetworkReady=false
# (NetworkPluginNotReady) until it is there and usable.
conf_dir = "/etc/cni/net.d"
# Where the plugins are looked for, in order.
bin_dirs = ["/opt/cni/bin", "/usr/lib/cni"]
# Each attachment's config and result, for a DEL after a restart or a config
# change; empty = STATE_DIR/cni.
cache_dir = ""
# A config template rendered with the pod CIDR of UpdateRuntimeConfig into
# conf_dir/10-cri-shim-net.conflist ({{.PodCIDR}}, {{.HostLocalRanges}},
# {{.DefaultRoutes}}); empty = none.
conf_template = ""
# Seconds each plugin run may take; it is killed after.
plugin_timeout = 30.0

[logging]
# debug, info, warning, error
level = "info"
# console or json
format = "console"
"""


def _check(section: str, data: Mapping[str, Any], cls: type[Any]) -> dict[str, Any]:
    fields = {f.name: f for f in dataclasses.fields(cls)}
    out: dict[str, Any] = {}
    for key, value in data.items():
        f = fields.get(key)
        if f is None:
            raise ConfigError(f"[{section}] unknown key {key!r} (known: {', '.join(sorted(fields))})")
        default = f.default
        if key == "socket_mode":
            try:
                value = int(value, 8) if isinstance(value, str) else int(value)
            except ValueError:
                raise ConfigError(f'[{section}] {key}: {value!r} is not an octal mode like "0660"') from None
        elif isinstance(default, bool):
            if not isinstance(value, bool):
                raise ConfigError(f"[{section}] {key}: expected true or false, got {value!r}")
        elif isinstance(default, float):
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
                raise ConfigError(f"[{section}] {key}: expected a non-negative number, got {value!r}")
            value = float(value)
        elif isinstance(default, int):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ConfigError(f"[{section}] {key}: expected a non-negative integer, got {value!r}")
        elif isinstance(default, str) and not isinstance(value, str):
            raise ConfigError(f"[{section}] {key}: expected a string, got {value!r}")
        elif isinstance(default, tuple):
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise ConfigError(f"[{section}] {key}: expected a list of strings, got {value!r}")
            value = tuple(value)
        out[key] = value
    return out


def parse(data: Mapping[str, Any]) -> Config:
    known = {"server", "handlers", "images", "streaming", "logging", "nri", "cni"}
    for section in data:
        if section not in known:
            raise ConfigError(f"unknown section [{section}] (known: {', '.join(sorted(known))})")
        if not isinstance(data[section], Mapping):
            raise ConfigError(f"[{section}] must be a table")
    server = ServerConfig(**_check("server", data.get("server", {}), ServerConfig))
    images, notices = _images(data.get("images", {}))
    streaming = StreamingSettings(**_check("streaming", data.get("streaming", {}), StreamingSettings))
    logging_ = LoggingConfig(**_check("logging", data.get("logging", {}), LoggingConfig))
    nri = NriConfig(**_check("nri", data.get("nri", {}), NriConfig))
    cni = CniConfig(**_check("cni", data.get("cni", {}), CniConfig))
    if not cni.conf_dir:
        raise ConfigError("[cni] conf_dir: must not be empty")
    if not cni.bin_dirs:
        raise ConfigError("[cni] bin_dirs: needs at least one directory")
    if cni.plugin_timeout <= 0:
        raise ConfigError("[cni] plugin_timeout: must be more than 0")
    if nri.enable and not nri.socket_path.startswith("/"):
        raise ConfigError(f"[nri] socket_path: {nri.socket_path!r} is not an absolute path")
    if nri.registration_timeout <= 0 or nri.request_timeout <= 0:
        raise ConfigError("[nri] registration_timeout and request_timeout must be more than 0")
    if logging_.level not in ("debug", "info", "warning", "error"):
        raise ConfigError(f"[logging] level: {logging_.level!r} is not one of debug, info, warning, error")
    if logging_.format not in ("console", "json"):
        raise ConfigError(f"[logging] format: {logging_.format!r} is not one of console, json")
    if server.event_loop not in ("uvloop", "asyncio"):
        raise ConfigError(f"[server] event_loop: {server.event_loop!r} is not uvloop or asyncio")
    if server.transport not in ("grpcio", "native"):
        raise ConfigError(f"[server] transport: {server.transport!r} is not grpcio or native")
    if server.cgroup_driver not in ("cgroupfs", "systemd"):
        raise ConfigError(f"[server] cgroup_driver: {server.cgroup_driver!r} is not cgroupfs or systemd")
    handlers: dict[str, HandlerConfig] = {}
    raw_handlers = data.get("handlers")
    if raw_handlers is None:
        handlers["fake"] = HandlerConfig("fake", "fake", {})
    else:
        for name, table in raw_handlers.items():
            if not isinstance(table, Mapping):
                raise ConfigError(f"[handlers.{name}] must be a table")
            opts = dict(table)
            kind = opts.pop("type", name)
            if kind not in BACKEND_TYPES:
                raise ConfigError(
                    f"[handlers.{name}] type: {kind!r} is not one of {', '.join(BACKEND_TYPES)}"
                )
            handlers[name] = HandlerConfig(name, kind, opts)
    cfg = Config(
        server=server,
        handlers=handlers,
        images=images,
        streaming=streaming,
        logging=logging_,
        nri=nri,
        cni=cni,
        notices=notices,
    )
    if server.default_handler not in handlers:
        cfg = cfg.with_handler(server.default_handler)
    return cfg


def _images(data: Mapping[str, Any]) -> tuple[ImagesConfig, tuple[str, ...]]:
    """The [images] section, checked; and the notices of its deprecated keys."""
    data = dict(data)
    notices: list[str] = []
    if "pull_no_progress_timeout" in data:
        if "image_pull_progress_timeout" in data:
            raise ConfigError(
                "[images] pull_no_progress_timeout is the old name of image_pull_progress_timeout: "
                "set only image_pull_progress_timeout"
            )
        data["image_pull_progress_timeout"] = data.pop("pull_no_progress_timeout")
        notices.append(
            "[images] pull_no_progress_timeout is deprecated: it is read as image_pull_progress_timeout "
            "(a pull is cancelled when no byte arrived for that long); rename it"
        )
    images = ImagesConfig(**_check("images", data, ImagesConfig))
    if images.max_concurrent_downloads < 1:
        raise ConfigError("[images] max_concurrent_downloads: must be at least 1")
    if "config_path" in data and images.config_path and not os.path.isdir(images.config_path):
        raise ConfigError(f"[images] config_path: {images.config_path!r} is not a directory")
    if images.credentials_file and not os.path.isfile(images.credentials_file):
        raise ConfigError(f"[images] credentials_file: {images.credentials_file!r} is not a file")
    try:
        PinnedImages.of(images.pinned, images.pause_image)
    except InvalidArgumentError as exc:
        raise ConfigError(f"[images] {exc.message}") from None
    return images, tuple(notices)


def load(path: str | None) -> Config:
    if not path:
        return Config()
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
    return parse(data)


def default_config() -> Config:
    return parse(tomllib.loads(DEFAULT_TOML))
