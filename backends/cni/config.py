"""The network configuration: the first file of the config directory, validated, reloaded on change.

The network is the first file, in lexical order, whose name ends in ``.conflist``, ``.conf`` or
``.json`` (as the kubelet's runtimes pick it; an invalid first file is an error, not skipped). A
file whose object has ``plugins`` is a configuration list; any other is a single plugin
configuration, wrapped as a one-plugin list. Errors name the file and the field.

The version in use is the highest that this client supports of ``cniVersion`` and ``cniVersions``
(SPEC.md, "Version considerations"). Each plugin's request is its configuration object with
``name`` and ``cniVersion`` put in, ``capabilities`` and ``cni.dev/`` keys taken out, and
``runtimeConfig`` holding the capability arguments it declares (SPEC.md section 3).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Mapping
from typing import Any

from backends.cni.errors import ConfigError

SUPPORTED_VERSIONS = ("0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0")
EXTENSIONS = (".conflist", ".conf", ".json")
# Network and plugin names become file names (the cache, plugin paths): no separators.
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]*\Z")


def version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("."))


@dataclasses.dataclass(frozen=True, slots=True)
class PluginConf:
    type: str
    capabilities: frozenset[str]  # those set to true
    ipam_type: str  # "" without a delegated IPAM plugin
    raw: Mapping[str, Any]


@dataclasses.dataclass(frozen=True, slots=True)
class NetworkConfig:
    name: str
    version: str
    plugins: tuple[PluginConf, ...]
    disable_check: bool
    disable_gc: bool
    source: str  # the file (or cache entry) it was read from
    raw: Mapping[str, Any]  # the list as loaded, a single plugin already wrapped: what the cache keeps

    def at_least(self, version: str) -> bool:
        """0.4.0 brought CHECK and prevResult on DEL; 1.1.0 STATUS and GC."""
        return version_tuple(self.version) >= version_tuple(version)

    def plugin_types(self) -> list[str]:
        """Every executable the network runs, delegated IPAM plugins included, once each."""
        types: list[str] = []
        for plugin in self.plugins:
            for name in (plugin.type, plugin.ipam_type):
                if name and name not in types:
                    types.append(name)
        return types


def _flag(obj: Mapping[str, Any], key: str, source: str) -> bool:
    value = obj.get(key, False)
    # Some configs in the field write the flag as a string.
    if value in ("true", "false"):
        return bool(value == "true")
    if not isinstance(value, bool):
        raise ConfigError(source, key, f"must be a boolean, not {value!r}")
    return value


def _type_name(value: object, source: str, field: str) -> str:
    if not isinstance(value, str) or not value:
        raise ConfigError(source, field, "missing or not a string")
    if not _NAME.match(value):
        raise ConfigError(source, field, f"{value!r} is not a plugin name")
    return value


def _plugin(obj: object, source: str, prefix: str) -> PluginConf:
    if not isinstance(obj, dict):
        raise ConfigError(source, prefix.rstrip(".") or "(top)", "must be an object")
    type_ = _type_name(obj.get("type"), source, prefix + "type")
    caps = obj.get("capabilities", {})
    if not isinstance(caps, dict) or not all(isinstance(v, bool) for v in caps.values()):
        raise ConfigError(source, prefix + "capabilities", "must be an object of booleans")
    ipam = obj.get("ipam", {})
    if not isinstance(ipam, dict):
        raise ConfigError(source, prefix + "ipam", "must be an object")
    ipam_type = _type_name(ipam["type"], source, prefix + "ipam.type") if "type" in ipam else ""
    return PluginConf(type_, frozenset(k for k, v in caps.items() if v), ipam_type, obj)


def _select_version(obj: Mapping[str, Any], source: str) -> str:
    declared = obj.get("cniVersion")
    if not isinstance(declared, str) or not declared:
        raise ConfigError(source, "cniVersion", "missing or not a string")
    others = obj.get("cniVersions", [])
    if not isinstance(others, list) or not all(isinstance(v, str) for v in others):
        raise ConfigError(source, "cniVersions", "must be a list of strings")
    usable = [str(v) for v in (declared, *others) if v in SUPPORTED_VERSIONS]
    if not usable:
        supported = ", ".join(SUPPORTED_VERSIONS)
        raise ConfigError(source, "cniVersion", f"{declared!r} is not supported (supported: {supported})")
    return max(usable, key=version_tuple)


def parse_network(data: object, source: str) -> NetworkConfig:
    """A configuration list, or a single plugin configuration wrapped as one, from decoded JSON."""
    if not isinstance(data, dict):
        raise ConfigError(source, "", "not a JSON object")
    name = data.get("name")
    if not isinstance(name, str) or not name:
        raise ConfigError(source, "name", "missing or not a string")
    if not _NAME.match(name):
        raise ConfigError(source, "name", f"{name!r} is not a network name")
    version = _select_version(data, source)
    if "plugins" in data:
        items = data["plugins"]
        if not isinstance(items, list) or not items:
            raise ConfigError(source, "plugins", "must be a non-empty list")
        plugins = tuple(_plugin(p, source, f"plugins[{i}].") for i, p in enumerate(items))
        raw = data
    else:
        plugins = (_plugin(data, source, ""),)
        kept = ("cniVersion", "cniVersions", "name", "disableCheck", "disableGC")
        raw = {k: data[k] for k in kept if k in data} | {"plugins": [data]}
    return NetworkConfig(
        name=name,
        version=version,
        plugins=plugins,
        disable_check=_flag(data, "disableCheck", source),
        disable_gc=_flag(data, "disableGC", source),
        source=source,
        raw=raw,
    )


def load_file(path: str) -> NetworkConfig:
    try:
        with open(path, "rb") as f:
            data = json.load(f)
    except OSError as exc:
        raise ConfigError(path, "", exc.strerror or str(exc)) from exc
    except ValueError as exc:
        raise ConfigError(path, "", f"invalid JSON: {exc}") from exc
    return parse_network(data, path)


def request_config(
    net: NetworkConfig,
    plugin: PluginConf,
    *,
    prev_result: Mapping[str, Any] | None = None,
    runtime_args: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """What one plugin reads on stdin (SPEC.md, "Deriving request configuration")."""
    conf = {k: v for k, v in plugin.raw.items() if k != "capabilities" and not k.startswith("cni.dev/")}
    conf["cniVersion"] = net.version
    conf["name"] = net.name
    if runtime_args is not None:
        wanted = {k: v for k, v in runtime_args.items() if k in plugin.capabilities}
        if wanted:
            conf["runtimeConfig"] = wanted
    if prev_result is not None:
        conf["prevResult"] = prev_result
    return conf


class ConfigDir:
    """The network of a config directory, read again only when its first file changes.

    Each call lists the directory and stats one file; nothing polls in between.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._seen: tuple[object, ...] | None = None
        self._loaded: NetworkConfig | ConfigError | None = None

    def first_file(self) -> str | None:
        try:
            with os.scandir(self.path) as entries:
                names = [e.name for e in entries if e.name.endswith(EXTENSIONS) and e.is_file()]
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise ConfigError(self.path, "", exc.strerror or str(exc)) from exc
        return os.path.join(self.path, min(names)) if names else None

    def current(self) -> NetworkConfig:
        path = self.first_file()
        if path is None:
            raise ConfigError(self.path, "", "no network config (*.conflist, *.conf, *.json)")
        try:
            st = os.stat(path)
        except OSError as exc:
            raise ConfigError(path, "", exc.strerror or str(exc)) from exc
        seen = (path, st.st_ino, st.st_mtime_ns, st.st_ctime_ns, st.st_size)
        if seen != self._seen or self._loaded is None:
            try:
                self._loaded = load_file(path)
            except ConfigError as exc:
                self._loaded = exc
            self._seen = seen
        if isinstance(self._loaded, ConfigError):
            # A fresh exception each time: re-raising one instance would grow its traceback.
            err = self._loaded
            raise ConfigError(err.source, err.field, err.problem)
        return self._loaded
