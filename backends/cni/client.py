"""The CNI client: ADD, CHECK, DEL, STATUS and GC of the node's network, and its readiness.

Ordering (SPEC.md section 3): operations on one container run one at a time, on different
containers concurrently; a GC runs alone, after those under way and before the next. An ADD
runs the plugins in order, each given the previous one's result; one that fails is followed by
a DEL of the whole chain, so nothing is left. A DEL runs the plugins in reverse order from the
cache entry (the config the ADD ran, its parameters, its result as ``prevResult``): a missing
network namespace is passed as none, a plugin no longer installed is skipped, a plugin's
"unknown container" error counts as done, and an attachment with no cache entry has nothing to
delete (the entry is written before an ADD starts).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import ipaddress
import json
import os
from collections.abc import AsyncIterator, Iterable
from typing import Any

import structlog

from backends.cni.attachment import Attachment
from backends.cni.cache import AttachmentCache, CacheEntry
from backends.cni.config import ConfigDir, NetworkConfig, PluginConf, parse_network, request_config
from backends.cni.errors import (
    CODE_UNKNOWN_CONTAINER,
    ConfigError,
    GcError,
    PluginError,
    PluginNotFoundError,
    ResultError,
)
from backends.cni.exec import Invocation, find_plugin, run_plugin
from backends.cni.result import Result, parse_result
from backends.cni.template import render
from backends.contract.errors import AlreadyExistsError, CriError, InvalidArgumentError, NotFoundError
from backends.linux.files import write_atomic

log = structlog.get_logger("cri-shim.cni")

NOT_READY = "NetworkPluginNotReady"


@dataclasses.dataclass(frozen=True, slots=True)
class CniSettings:
    conf_dir: str = "/etc/cni/net.d"
    bin_dirs: tuple[str, ...] = ("/opt/cni/bin", "/usr/lib/cni")
    cache_dir: str = "/var/lib/cri-shim/cni"
    plugin_timeout: float = 30.0  # seconds, for each plugin run
    conf_template: str = ""  # a template file rendered with the pod CIDRs (backends.cni.template)
    template_output: str = "10-cri-shim-net.conflist"  # its rendering's name in conf_dir


@dataclasses.dataclass(frozen=True, slots=True)
class Readiness:
    ready: bool
    reason: str = ""
    message: str = ""


class _Gate:
    """One operation per container at a time; a GC alone, and waiting GCs go before new operations."""

    def __init__(self) -> None:
        self._cond = asyncio.Condition()
        self._busy: set[str] = set()
        self._gc_waiting = 0
        self._gc_running = False

    @contextlib.asynccontextmanager
    async def container(self, container_id: str) -> AsyncIterator[None]:
        async with self._cond:
            await self._cond.wait_for(
                lambda: not self._gc_running and not self._gc_waiting and container_id not in self._busy
            )
            self._busy.add(container_id)
        try:
            yield
        finally:
            async with self._cond:
                self._busy.discard(container_id)
                self._cond.notify_all()

    @contextlib.asynccontextmanager
    async def alone(self) -> AsyncIterator[None]:
        async with self._cond:
            self._gc_waiting += 1
            try:
                await self._cond.wait_for(lambda: not self._gc_running and not self._busy)
            finally:
                self._gc_waiting -= 1
                self._cond.notify_all()  # a GC given up (cancelled) holds no one back
            self._gc_running = True
        try:
            yield
        finally:
            async with self._cond:
                self._gc_running = False
                self._cond.notify_all()


class CniClient:
    def __init__(self, settings: CniSettings) -> None:
        self.settings = settings
        self._dir = ConfigDir(settings.conf_dir)
        self._cache = AttachmentCache(settings.cache_dir)
        self._gate = _Gate()
        self._pod_cidrs: tuple[str, ...] = ()
        self._template_error = ""  # why the template could not be rendered with the pod CIDRs

    # ---- configuration

    def network(self) -> NetworkConfig:
        """The network in use, read again if the config directory's first file changed."""
        return self._dir.current()

    def set_pod_cidr(self, cidr: str) -> None:
        """The node's pod CIDRs (comma-separated, as UpdateRuntimeConfig gives them): passed as
        ``ipRanges`` to plugins that declare it, and rendered into the config template if any."""
        cidrs = tuple(c.strip() for c in cidr.split(",") if c.strip())
        for c in cidrs:
            try:
                ipaddress.ip_network(c, strict=False)
            except ValueError:
                raise InvalidArgumentError(f"pod CIDR {c!r} is not a network") from None
        self._pod_cidrs = cidrs
        self._render_template()

    def _render_template(self) -> None:
        """ConfigError naming the template (remembered for readiness) when it cannot be."""
        template = self.settings.conf_template
        if not template or not self._pod_cidrs:
            return
        try:
            try:
                with open(template, encoding="utf-8") as f:
                    text = f.read()
            except OSError as exc:
                raise ConfigError(template, "", exc.strerror or str(exc)) from exc
            rendered = render(text, self._pod_cidrs, template)
            out = os.path.join(self.settings.conf_dir, self.settings.template_output)
            with contextlib.suppress(OSError), open(out, encoding="utf-8") as f:
                if f.read() == rendered:
                    self._template_error = ""
                    return  # unchanged: its mtime stays, so nothing reloads
            try:
                os.makedirs(self.settings.conf_dir, exist_ok=True)
                write_atomic(out, rendered.encode())
            except OSError as exc:
                raise ConfigError(out, "", exc.strerror or str(exc)) from exc
        except ConfigError as exc:
            self._template_error = exc.message
            raise
        self._template_error = ""

    async def readiness(self) -> Readiness:
        """Ready when the config is valid, its plugins are installed and (1.1.0) STATUS passes."""
        if self._template_error:
            with contextlib.suppress(ConfigError):
                self._render_template()  # it may have been mended since
        try:
            net = self.network()
        except ConfigError as exc:
            hint = ""
            if self.settings.conf_template and not self._pod_cidrs:
                hint = f" (the template {self.settings.conf_template} waits for the pod CIDR)"
            elif self._template_error:
                hint = f" (the template could not be rendered: {self._template_error})"
            return Readiness(False, NOT_READY, f"CNI network config not ready: {exc.message}{hint}")
        missing = [t for t in net.plugin_types() if not _installed(t, self.settings.bin_dirs)]
        if missing:
            return Readiness(
                False,
                NOT_READY,
                f"CNI network {net.name} ({net.source}): plugin {', '.join(missing)} not found in "
                f"{':'.join(self.settings.bin_dirs)}",
            )
        try:
            await self.status()
        except CriError as exc:
            return Readiness(False, NOT_READY, f"CNI network {net.name} ({net.source}): {exc.message}")
        return Readiness(True)

    def cached_result(self, container_id: str, ifname: str = "eth0") -> Result | None:
        """The result of the attachment's ADD, as cached (after a restart, say)."""
        for entry in self._cache.entries(container_id, ifname):
            if entry.result is not None:
                with contextlib.suppress(ValueError, ConfigError):
                    return parse_result(entry.result, self._cached_network(entry).version)
        return None

    # ---- operations

    async def _run(self, plugin: PluginConf, invocation: Invocation, conf: dict[str, Any]) -> bytes:
        settings = self.settings
        return await run_plugin(plugin.type, settings.bin_dirs, invocation, conf, settings.plugin_timeout)

    async def add(self, att: Attachment) -> Result:
        net = self.network()
        async with self._gate.container(att.container_id):
            if await asyncio.to_thread(self._cache.read, net.name, att.container_id, att.ifname):
                raise AlreadyExistsError(
                    f"CNI network {net.name} already has {att.container_id}/{att.ifname}: DEL it first"
                )
            entry = CacheEntry(
                network=net.name,
                container_id=att.container_id,
                ifname=att.ifname,
                netns=att.netns,
                cni_args=att.cni_args(),
                runtime_args=att.runtime_args(self._pod_cidrs),
                config=net.raw,
            )
            await asyncio.to_thread(self._cache.write, entry)
            try:
                result = await self._add_chain(net, entry)
                await asyncio.to_thread(self._cache.write, dataclasses.replace(entry, result=result.raw))
            except BaseException as exc:
                await self._undo(entry, exc)
                raise
            return result

    async def _add_chain(self, net: NetworkConfig, entry: CacheEntry) -> Result:
        invocation = Invocation("ADD", entry.container_id, entry.netns, entry.ifname, entry.cni_args)
        prev: dict[str, Any] | None = None
        result: Result | None = None
        for plugin in net.plugins:
            conf = request_config(net, plugin, prev_result=prev, runtime_args=entry.runtime_args)
            out = await self._run(plugin, invocation, conf)
            try:
                prev = json.loads(out)
                result = parse_result(prev, net.version)
            except ValueError as exc:
                raise ResultError(plugin.type, str(exc)) from None
        assert result is not None  # a network has at least one plugin
        return result

    async def _undo(self, entry: CacheEntry, cause: BaseException) -> None:
        log.warning(
            "cni ADD failed; deleting what it made",
            network=entry.network,
            container_id=entry.container_id,
            error=str(cause) or type(cause).__name__,
        )
        try:
            await self._delete_entry(entry)
        except Exception as exc:
            # The entry stays: a later DEL (the runtime's, or a GC) finishes the job.
            log.error(
                "cni DEL after a failed ADD failed",
                network=entry.network,
                container_id=entry.container_id,
                error=str(exc),
            )

    async def check(self, att: Attachment) -> None:
        """CHECK the attachment with the config and result its ADD left; nothing to do below
        0.4.0 or with ``disableCheck``. NotFoundError if it was never added."""
        async with self._gate.container(att.container_id):
            entries = await asyncio.to_thread(self._cache.entries, att.container_id, att.ifname)
            added = [e for e in entries if e.result is not None]
            if not added:
                raise NotFoundError(f"no CNI attachment {att.container_id}/{att.ifname} to check")
            for entry in added:
                net = self._cached_network(entry)
                if not net.at_least("0.4.0") or net.disable_check:
                    continue
                netns = att.netns or entry.netns
                invocation = Invocation("CHECK", entry.container_id, netns, entry.ifname, entry.cni_args)
                for plugin in net.plugins:
                    conf = request_config(
                        net, plugin, prev_result=entry.result, runtime_args=entry.runtime_args
                    )
                    await self._run(plugin, invocation, conf)

    async def delete(self, att: Attachment) -> None:
        """DEL the attachment, from every network it is cached in; done twice is done."""
        async with self._gate.container(att.container_id):
            for entry in await asyncio.to_thread(self._cache.entries, att.container_id, att.ifname):
                await self._delete_entry(entry)

    def _cached_network(self, entry: CacheEntry) -> NetworkConfig:
        source = f"cache {self._cache.path(entry.network, entry.container_id, entry.ifname)}"
        return parse_network(entry.config, source)

    async def _delete_entry(self, entry: CacheEntry) -> None:
        net = self._cached_network(entry)
        netns = _existing(entry.netns)
        invocation = Invocation("DEL", entry.container_id, netns, entry.ifname, entry.cni_args)
        prev = entry.result if net.at_least("0.4.0") else None
        for plugin in reversed(net.plugins):
            conf = request_config(net, plugin, prev_result=prev, runtime_args=entry.runtime_args)
            try:
                await self._run(plugin, invocation, conf)
            except PluginNotFoundError as exc:
                log.warning("cni DEL: plugin not installed, skipped", network=net.name, error=exc.message)
            except PluginError as exc:
                if exc.code != CODE_UNKNOWN_CONTAINER:
                    raise
        await asyncio.to_thread(self._cache.remove, entry)

    async def status(self) -> None:
        """STATUS of every plugin (1.1.0 and later; nothing to ask before): PluginError if one
        cannot serve ADDs."""
        net = self.network()
        if not net.at_least("1.1.0"):
            return
        for plugin in net.plugins:
            await self._run(plugin, Invocation("STATUS"), request_config(net, plugin))

    async def gc(self, valid: Iterable[tuple[str, str]], *, plugins: bool = True) -> None:
        """Given the (container ID, ifname) attachments that still exist: DEL every other cached
        one, then (1.1.0 and later, unless ``disableGC``, and ``plugins``) GC every plugin with
        the valid list. Failures do not stop it; they are raised together at the end (GcError)."""
        keep = set(valid)
        failures: list[CriError] = []
        async with self._gate.alone():
            for entry in await asyncio.to_thread(self._cache.entries):
                if (entry.container_id, entry.ifname) not in keep:
                    try:
                        await self._delete_entry(entry)
                    except CriError as exc:
                        failures.append(exc)
            try:
                net: NetworkConfig | None = self.network() if plugins else None
            except ConfigError:
                net = None
            if net is not None and net.at_least("1.1.0") and not net.disable_gc:
                attachments = [{"containerID": c, "ifname": i} for c, i in sorted(keep)]
                for plugin in net.plugins:
                    conf = request_config(net, plugin)
                    conf["cni.dev/valid-attachments"] = attachments
                    try:
                        await self._run(plugin, Invocation("GC"), conf)
                    except CriError as exc:
                        failures.append(exc)
        if failures:
            raise GcError(failures)


def _existing(netns: str) -> str:
    # A namespace already gone is passed as none: the plugins then clean up the host side.
    return netns if netns and os.path.exists(netns) else ""


def _installed(plugin: str, dirs: tuple[str, ...]) -> bool:
    try:
        find_plugin(plugin, dirs)
    except PluginNotFoundError:
        return False
    return True
