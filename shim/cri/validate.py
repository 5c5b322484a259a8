"""Request validation shared by the services. Each error names the bad field."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

from backends.contract import MOUNT_OPTIONS, Capability, host_signal
from cri_api import api_pb2 as pb
from shim.cri.errors import InvalidArgumentError, UnimplementedError

MAX_NAME = 253  # DNS subdomain length: what the kubelet itself allows for names
MAX_LABELS = 1024
MAX_KEY = 4096
MAX_VALUE = 256 * 1024
MAX_ARGS = 65536


def require(cond: bool, message: str) -> None:
    if not cond:
        raise InvalidArgumentError(message)


def name(value: str, field: str) -> None:
    require(bool(value), f"{field} must not be empty")
    require(
        len(value) <= MAX_NAME, f"{field} is {len(value)} characters long; at most {MAX_NAME} are allowed"
    )
    require("/" not in value and "\x00" not in value, f"{field} {value!r} must not contain '/' or NUL")


def string_map(values: Mapping[str, str], field: str) -> None:
    require(len(values) <= MAX_LABELS, f"{field} has {len(values)} entries; at most {MAX_LABELS} are allowed")
    for k, v in values.items():
        require(bool(k), f"{field} has an empty key")
        require(len(k) <= MAX_KEY, f"{field} key {k[:40]!r}... is longer than {MAX_KEY} characters")
        require(len(v) <= MAX_VALUE, f"{field}[{k!r}] is longer than {MAX_VALUE} characters")


def sandbox_config(cfg: pb.PodSandboxConfig, present: bool) -> None:
    require(present, "config is required")
    require(cfg.HasField("metadata"), "config.metadata is required")
    name(cfg.metadata.name, "config.metadata.name")
    name(cfg.metadata.namespace, "config.metadata.namespace")
    require(bool(cfg.metadata.uid), "config.metadata.uid must not be empty")
    require(len(cfg.metadata.uid) <= MAX_NAME, "config.metadata.uid is too long")
    require(cfg.metadata.attempt >= 0, "config.metadata.attempt must not be negative")
    require(len(cfg.hostname) <= 253, f"config.hostname is {len(cfg.hostname)} characters long; at most 253")
    if cfg.log_directory:
        require(
            os.path.isabs(cfg.log_directory), f"config.log_directory {cfg.log_directory!r} must be absolute"
        )
    for i, pm in enumerate(cfg.port_mappings):
        require(0 < pm.container_port <= 65535, f"config.port_mappings[{i}].container_port must be 1-65535")
        require(0 <= pm.host_port <= 65535, f"config.port_mappings[{i}].host_port must be 0-65535")
        require(pm.protocol in (pb.TCP, pb.UDP, pb.SCTP), f"config.port_mappings[{i}].protocol is unknown")
    string_map(cfg.labels, "config.labels")
    string_map(cfg.annotations, "config.annotations")
    ns = cfg.linux.security_context.namespace_options
    for fld in ("network", "pid", "ipc"):
        require(
            getattr(ns, fld) in (pb.POD, pb.CONTAINER, pb.NODE, pb.TARGET),
            f"config.linux.security_context.namespace_options.{fld} is not a known NamespaceMode",
        )


def container_config(cfg: pb.ContainerConfig, present: bool) -> None:
    require(present, "config is required")
    require(cfg.HasField("metadata"), "config.metadata is required")
    name(cfg.metadata.name, "config.metadata.name")
    require(cfg.metadata.attempt >= 0, "config.metadata.attempt must not be negative")
    require(cfg.HasField("image") and bool(cfg.image.image), "config.image.image must not be empty")
    require(len(cfg.command) + len(cfg.args) <= MAX_ARGS, "config.command and config.args are too long")
    string_map(cfg.labels, "config.labels")
    string_map(cfg.annotations, "config.annotations")
    for i, m in enumerate(cfg.mounts):
        require(bool(m.container_path), f"config.mounts[{i}].container_path must not be empty")
        require(os.path.isabs(m.container_path), f"config.mounts[{i}].container_path must be absolute")
    for i, kv in enumerate(cfg.envs):
        require(bool(kv.key), f"config.envs[{i}].key must not be empty")
        require("=" not in kv.key, f"config.envs[{i}].key {kv.key!r} must not contain '='")
    sc = cfg.linux.security_context
    require(
        not (sc.HasField("run_as_group") and not sc.HasField("run_as_user") and not sc.run_as_username),
        "config.linux.security_context.run_as_group is set without run_as_user or run_as_username",
    )
    linux_resources(cfg.linux.resources, "config.linux.resources")
    require(
        not cfg.stop_signal or host_signal(cfg.stop_signal) is not None,
        f"config.stop_signal {cfg.stop_signal} is not a signal this host has",
    )


def groups_policy_for(cfg: pb.ContainerConfig, caps: Capability, handler: str) -> None:
    """SupplementalGroupsPolicy Strict only where the handler honours it: never a silent merge."""
    if cfg.linux.security_context.supplemental_groups_policy == pb.Strict:
        require(
            bool(caps & Capability.SUPPLEMENTAL_GROUPS_POLICY),
            f"config.linux.security_context.supplemental_groups_policy: handler {handler!r} cannot honour "
            "Strict (it merges the image's groups)",
        )


def userns_for(cfg: pb.PodSandboxConfig, caps: Capability, handler: str, why: str = "") -> None:
    """The pod's user namespace: NODE (the host's), or POD with one uid and one gid mapping of ID 0.
    ``why``: the handler's reason for having none, said in the refusal."""
    where = "config.linux.security_context.namespace_options.userns_options"
    ns = cfg.linux.security_context.namespace_options
    if not ns.HasField("userns_options"):
        return  # unset (as a kubelet before 1.30 leaves it): the host's
    opts = ns.userns_options
    if opts.mode == pb.NODE:
        require(not opts.uids and not opts.gids, f"{where}: mappings are only for mode POD")
        return
    require(opts.mode == pb.POD, f"{where}.mode: only NODE and POD are supported")
    require(
        bool(caps & Capability.USER_NAMESPACES),
        f"{where}: handler {handler!r} does not support user namespaces" + (f": {why}" if why else ""),
    )
    for kind, maps in (("uids", opts.uids), ("gids", opts.gids)):
        require(len(maps) == 1, f"{where}.{kind}: exactly one mapping is supported, got {len(maps)}")
        mp = maps[0]
        require(
            mp.container_id == 0,
            f"{where}.{kind}: container ID 0 must be mapped (the mapping starts at {mp.container_id})",
        )
        require(mp.length > 0, f"{where}.{kind}: the mapping is empty")
        require(
            mp.host_id + mp.length <= 1 << 32,
            f"{where}.{kind}: host IDs {mp.host_id}+{mp.length} exceed 32 bits",
        )


def mounts_for(cfg: pb.ContainerConfig, caps: Capability, handler: str) -> None:
    """Refuse, naming it, a mount the handler cannot honour: never a silently dropped volume."""
    for i, m in enumerate(cfg.mounts):
        where = f"config.mounts[{i}] ({m.container_path})"
        image = m.HasField("image") and bool(m.image.image)
        if image:
            if not caps & Capability.IMAGE_VOLUMES:
                # UNIMPLEMENTED is how a runtime says it has no image volumes (critest skips on it).
                raise UnimplementedError(f"{where}: image volumes are not supported by handler {handler!r}")
            require(not m.host_path, f"{where} has both a host_path and an image")
            require(m.readonly, f"{where}: an image volume is read-only (set readonly)")
            sub = m.image_sub_path
            require(
                not sub.startswith("/") and ".." not in sub.split("/") and "\x00" not in sub,
                f"{where}: image_sub_path {sub!r} must be a relative path inside the image",
            )
            continue
        require(bool(m.host_path), f"{where} has neither a host_path nor an image")
        require(not m.image_sub_path, f"{where}: image_sub_path is only for image volumes")
        for option in m.mount_options:
            require(
                option in MOUNT_OPTIONS,
                f"{where}: mount option {option!r} is not one any handler applies "
                f"(these are: {', '.join(MOUNT_OPTIONS)})",
            )
            require(
                bool(caps & Capability.MOUNT_OPTIONS),
                f"{where}: handler {handler!r} does not apply mount options ({option!r})",
            )
        if m.uidMappings or m.gidMappings:
            require(
                bool(caps & Capability.USER_NAMESPACES),
                f"{where}: idmapped mounts need user namespaces, which handler {handler!r} does not support",
            )
        if m.recursive_read_only:
            require(
                bool(caps & Capability.RECURSIVE_READ_ONLY_MOUNTS),
                f"{where}: handler {handler!r} does not support recursive read-only mounts",
            )
            require(m.readonly, f"{where}: a recursive read-only mount must be read-only")
            require(
                m.propagation == pb.PROPAGATION_PRIVATE,
                f"{where}: a recursive read-only mount must have private propagation",
            )


def log_path(log_directory: str, path: str) -> str:
    """log_directory + log_path, refusing a path that escapes the directory."""
    if not log_directory or not path:
        return ""
    require(
        not os.path.isabs(path), f"config.log_path {path!r} must be relative to the sandbox's log_directory"
    )
    require("\x00" not in path, "config.log_path must not contain NUL")
    base = os.path.normpath(log_directory)
    full = os.path.normpath(os.path.join(base, path))
    require(
        full.startswith(base + os.sep) and full != base,
        f"config.log_path {path!r} escapes the sandbox's log_directory {log_directory!r}",
    )
    return full


_CPU_LIST = re.compile(r"\d+(-\d+)?(,\d+(-\d+)?)*")
_PAGE_SIZE = re.compile(r"\d+(KB|MB|GB|TB)")
_UNIFIED_KEY = re.compile(r"[a-z][a-z0-9_]*\.[a-z0-9_.]+")
MAX_CFS_QUOTA_US = (1 << 44) - 1  # what the kernel's cpu.cfs_quota_us / cpu.max accept


def linux_resources(res: pb.LinuxContainerResources, field: str) -> None:
    """Values the kernel cannot take are refused here, before any runtime tries them (and
    fails with its own text): the kernel's ranges for CFS, shares and OOM score, cpuset lists,
    hugepage sizes, and cgroup v2 file names."""
    require(res.memory_limit_in_bytes >= 0, f"{field}.memory_limit_in_bytes must not be negative")
    require(res.cpu_shares >= 0, f"{field}.cpu_shares must not be negative")
    require(
        res.cpu_shares == 0 or 2 <= res.cpu_shares <= 262144,
        f"{field}.cpu_shares {res.cpu_shares} is outside 2..262144",
    )
    require(res.cpu_period >= 0, f"{field}.cpu_period must not be negative")
    require(
        res.cpu_period == 0 or 1000 <= res.cpu_period <= 1_000_000,
        f"{field}.cpu_period {res.cpu_period} is outside 1000..1000000 microseconds",
    )
    require(res.cpu_quota >= -1, f"{field}.cpu_quota must be -1 or more")
    require(
        res.cpu_quota in (-1, 0) or 1000 <= res.cpu_quota <= MAX_CFS_QUOTA_US,
        f"{field}.cpu_quota {res.cpu_quota} is outside 1000..{MAX_CFS_QUOTA_US} microseconds",
    )
    require(
        -1000 <= res.oom_score_adj <= 1000,
        f"{field}.oom_score_adj {res.oom_score_adj} is outside -1000..1000",
    )
    require(res.memory_swap_limit_in_bytes >= -1, f"{field}.memory_swap_limit_in_bytes must be -1 or more")
    for name in ("cpuset_cpus", "cpuset_mems"):
        value = getattr(res, name)
        require(
            not value or bool(_CPU_LIST.fullmatch(value)),
            f"{field}.{name} {value!r} is not a list such as 0-3,5",
        )
    for i, h in enumerate(res.hugepage_limits):
        require(
            bool(_PAGE_SIZE.fullmatch(h.page_size)),
            f"{field}.hugepage_limits[{i}].page_size {h.page_size!r} is not a size such as 2MB or 1GB",
        )
    for key in res.unified:
        require(
            bool(_UNIFIED_KEY.fullmatch(key)) and ".." not in key,
            f"{field}.unified key {key!r} is not a cgroup v2 file name",
        )
