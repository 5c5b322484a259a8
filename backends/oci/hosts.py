"""Registry hosts, containerd's model: one directory per registry host namespace under
``config_path``, each with a ``hosts.toml``::

    <config_path>/docker.io/hosts.toml           images of docker.io
    <config_path>/myreg.io:5000/hosts.toml       (or myreg.io_5000_/) images of myreg.io:5000
    <config_path>/_default/hosts.toml            any registry without a directory of its own

A file names the namespace's ``server`` (default: the image's registry itself) and its mirrors,
``[host."https://mirror"]`` tables, tried in the order written and the server last. Top-level
keys other than ``server`` and ``host`` configure the server; the same keys in a ``host`` table
configure that mirror: ``capabilities`` (of pull, resolve, push; all by default), ``ca`` (a path
or a list), ``client`` (a path, a list of paths, or of [cert, key] pairs), ``skip_verify``,
``override_path`` (the URL's path is the API root, no ``/v2`` added), ``header`` (a table of
name = value or [values]) and ``dial_timeout`` ("1s", "500ms", or seconds). Relative paths are
relative to the file. A directory without a ``hosts.toml`` is read Docker's way: its ``*.crt``
are CAs of the server, each ``X.cert`` with ``X.key`` a client certificate.

Every file is parsed, and every certificate loaded, once by :func:`load_hosts`; a file that is
not TOML, or a key that is unknown or of the wrong type, raises :class:`HostsConfigError` naming
the file and the key.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import re
import ssl
import tomllib
import urllib.parse
from collections.abc import Collection, Mapping
from typing import Any

from backends.reference import DEFAULT_DOMAIN

CAPABILITIES = ("pull", "resolve", "push")
DEFAULT_DIAL_TIMEOUT = 30.0
DEFAULT_NAMESPACE = "_default"
_DOCKER_HUB = "registry-1.docker.io"
_HOST_KEYS = {"capabilities", "ca", "client", "skip_verify", "override_path", "header", "dial_timeout"}
_TOP_KEYS = _HOST_KEYS | {"server", "host"}
_UNSUPPORTED = {"proxy": "a proxy per host is not supported by cri-shim (HTTPS_PROXY is not read either)"}


class HostsConfigError(ValueError):
    """A hosts.toml (or a file it names) that cannot be used; the message names the file and key."""


@dataclasses.dataclass(frozen=True, slots=True)
class RegistryHost:
    """One host a pull may ask: a mirror or the namespace's server."""

    url: str  # scheme://netloc[/path], as logs and errors name it
    scheme: str  # http or https
    netloc: str  # host[:port]
    root: str  # the API root path: <path>/v2, or the URL's path as written with override_path
    capabilities: frozenset[str] = frozenset(CAPABILITIES)
    # Configured headers may carry a secret of the operator's: not in a repr.
    headers: tuple[tuple[str, str], ...] = dataclasses.field(default=(), repr=False)
    tls: ssl.SSLContext | None = dataclasses.field(default=None, compare=False, repr=False)
    dial_timeout: float = DEFAULT_DIAL_TIMEOUT
    mirror: bool = False  # a [host] table: asked with ?ns=<the image's registry>

    def can(self, capability: str) -> bool:
        return capability in self.capabilities


@dataclasses.dataclass(frozen=True, slots=True)
class _Options:
    """The keys a host table and the top level share, parsed."""

    capabilities: frozenset[str] = frozenset(CAPABILITIES)
    headers: tuple[tuple[str, str], ...] = ()
    tls: ssl.SSLContext | None = dataclasses.field(default=None, compare=False)
    override_path: bool = False
    dial_timeout: float = DEFAULT_DIAL_TIMEOUT


@dataclasses.dataclass(frozen=True, slots=True)
class Namespace:
    """One registry host namespace (one hosts.toml): its mirrors in order, and its server."""

    source: str  # the file (or directory) it was read from
    mirrors: tuple[RegistryHost, ...]
    server_url: str  # "" = the image's own registry
    server_options: _Options

    def server(self, domain: str, insecure: Collection[str]) -> RegistryHost:
        url = self.server_url or default_url(domain, insecure)
        return _host(url, self.server_options, mirror=False)


def default_url(domain: str, insecure: Collection[str]) -> str:
    """Where the registry API of ``domain`` answers when nothing says otherwise."""
    scheme = "http" if domain in insecure else "https"
    return f"{scheme}://{_DOCKER_HUB if domain == DEFAULT_DOMAIN else domain}"


_DEFAULT_SSL: list[ssl.SSLContext] = []


def _default_ssl() -> ssl.SSLContext:
    # One context (the system's CAs) for every host without TLS settings of its own.
    if not _DEFAULT_SSL:
        _DEFAULT_SSL.append(ssl.create_default_context())
    return _DEFAULT_SSL[0]


def _host(url: str, opts: _Options, mirror: bool) -> RegistryHost:
    parts = urllib.parse.urlsplit(url)
    path = parts.path.rstrip("/")
    if not opts.override_path and not path.endswith("/v2"):
        path += "/v2"
    return RegistryHost(
        url=f"{parts.scheme}://{parts.netloc}{parts.path.rstrip('/')}",
        scheme=parts.scheme,
        netloc=parts.netloc,
        root=path,
        capabilities=opts.capabilities,
        headers=opts.headers,
        tls=(opts.tls or _default_ssl()) if parts.scheme == "https" else None,
        dial_timeout=opts.dial_timeout,
        mirror=mirror,
    )


class Hosts:
    """The parsed configuration directory: which hosts a pull from a registry asks, in order."""

    def __init__(self, config_path: str = "", namespaces: Mapping[str, Namespace] | None = None) -> None:
        self.config_path = config_path
        self.namespaces = dict(namespaces or {})

    def namespace(self, domain: str) -> Namespace | None:
        """The namespace of ``domain``: its own directory (``host_port_`` before ``host:port``),
        else ``_default``, else none."""
        names = [domain]
        if ":" in domain and not domain.endswith("]"):
            names.insert(0, domain.replace(":", "_") + "_")
        for name in (*names, DEFAULT_NAMESPACE):
            if name in self.namespaces:
                return self.namespaces[name]
        return None

    def for_domain(self, domain: str, insecure: Collection[str] = ()) -> tuple[RegistryHost, ...]:
        """The hosts a pull of an image of ``domain`` tries: mirrors in order, the server last.
        ``insecure`` names registries spoken to in plain HTTP when no ``server`` says otherwise."""
        ns = self.namespace(domain)
        if ns is None:
            return (_host(default_url(domain, insecure), _Options(), mirror=False),)
        return (*ns.mirrors, ns.server(domain, insecure))


def load_hosts(config_path: str) -> Hosts:
    """Parse every ``<config_path>/*/hosts.toml`` (and Docker-style certificate directories).
    "" or a directory that does not exist: no configuration (every registry as itself)."""
    if not config_path or not os.path.isdir(config_path):
        if config_path and os.path.exists(config_path):
            raise HostsConfigError(f"registry config_path {config_path}: not a directory")
        return Hosts(config_path)
    namespaces: dict[str, Namespace] = {}
    for name in sorted(os.listdir(config_path)):
        directory = os.path.join(config_path, name)
        if not os.path.isdir(directory):
            continue
        path = os.path.join(directory, "hosts.toml")
        if os.path.exists(path):
            namespaces[name] = _parse_file(path)
        else:
            found = _docker_certs(directory)
            if found is not None:
                namespaces[name] = found
    return Hosts(config_path, namespaces)


# --------------------------------------------------------------------------- parsing


def _parse_file(path: str) -> Namespace:
    try:
        with open(path, "rb") as fh:
            doc = tomllib.load(fh)
    except tomllib.TOMLDecodeError as exc:
        raise HostsConfigError(f"{path}: not valid TOML: {exc}") from None
    except OSError as exc:
        raise HostsConfigError(f"{path}: cannot read: {exc.strerror}") from None
    where = _Where(path, os.path.dirname(path))
    _check_keys(doc, _TOP_KEYS, where, "")
    server = ""
    if "server" in doc:
        server = _url(doc["server"], where, "server")
    hosts_table = doc.get("host", {})
    if not isinstance(hosts_table, dict):
        raise where.error("host", 'must be tables [host."https://mirror"]')
    mirrors = []
    for url, table in hosts_table.items():
        key = f'host."{url}"'
        if not isinstance(table, dict):
            raise where.error(key, "must be a table")
        _check_keys(table, _HOST_KEYS, where, key + ".")
        if "host" in table or "server" in table:
            raise where.error(key, "a host table cannot hold other hosts")
        mirrors.append(_host(_url(url, where, key), _options(table, where, key + "."), mirror=True))
    return Namespace(path, tuple(mirrors), server, _options(doc, where, ""))


@dataclasses.dataclass(frozen=True, slots=True)
class _Where:
    path: str
    base: str  # relative paths start here

    def error(self, key: str, problem: str) -> HostsConfigError:
        return HostsConfigError(f"{self.path}: key {key}: {problem}")

    def file(self, value: str) -> str:
        return value if os.path.isabs(value) else os.path.join(self.base, value)


def _check_keys(table: Mapping[str, Any], allowed: set[str], where: _Where, prefix: str) -> None:
    for key in table:
        if key in _UNSUPPORTED:
            raise where.error(prefix + key, _UNSUPPORTED[key])
        if key not in allowed:
            raise where.error(prefix + key, f"unknown key (known: {', '.join(sorted(allowed))})")


def _url(value: Any, where: _Where, key: str) -> str:
    if not isinstance(value, str) or not value:
        raise where.error(key, f"must be a URL string, not {value!r}")
    url = value if "://" in value else f"https://{value}"
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc or parts.query or parts.fragment:
        raise where.error(key, f"{value!r} is not an http:// or https:// URL of a host")
    return url


def _options(table: Mapping[str, Any], where: _Where, prefix: str) -> _Options:
    caps = frozenset(CAPABILITIES)
    if "capabilities" in table:
        values = _strings(table["capabilities"], where, prefix + "capabilities", allow_str=False)
        bad = [v for v in values if v not in CAPABILITIES]
        if bad:
            raise where.error(prefix + "capabilities", f"{bad[0]!r} is not one of {', '.join(CAPABILITIES)}")
        caps = frozenset(values)
    headers: list[tuple[str, str]] = []
    header = table.get("header", {})
    if not isinstance(header, dict):
        raise where.error(prefix + "header", "must be a table of name = value or [values]")
    for name, value in header.items():
        hkey = f"{prefix}header.{name}"
        if not re.fullmatch(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+", name):
            raise where.error(hkey, "is not a valid header name")
        for v in _strings(value, where, hkey, allow_str=True):
            if any(ord(c) < 32 and c != "\t" for c in v):
                raise where.error(hkey, "a header value cannot hold control characters")
            headers.append((name, v))
    skip_verify = _bool(table, "skip_verify", where, prefix)
    override_path = _bool(table, "override_path", where, prefix)
    dial_timeout = DEFAULT_DIAL_TIMEOUT
    if "dial_timeout" in table:
        dial_timeout = _duration(table["dial_timeout"], where, prefix + "dial_timeout")
    ca = [where.file(p) for p in _strings(table.get("ca", []), where, prefix + "ca", allow_str=True)]
    client = _client(table.get("client", []), where, prefix + "client")
    context = None
    if ca or client or skip_verify:
        context = _ssl_context(ca, client, skip_verify, where, prefix)
    return _Options(caps, tuple(headers), context, override_path, dial_timeout)


def _strings(value: Any, where: _Where, key: str, allow_str: bool) -> list[str]:
    if allow_str and isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return list(value)
    kind = "a string or a list of strings" if allow_str else "a list of strings"
    raise where.error(key, f"must be {kind}, not {value!r}")


def _bool(table: Mapping[str, Any], name: str, where: _Where, prefix: str) -> bool:
    value = table.get(name, False)
    if not isinstance(value, bool):
        raise where.error(prefix + name, f"must be true or false, not {value!r}")
    return value


def _duration(value: Any, where: _Where, key: str) -> float:
    if isinstance(value, int | float) and not isinstance(value, bool) and value > 0:
        return float(value)
    units = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
    if isinstance(value, str) and re.fullmatch(r"(\d+(\.\d+)?(ms|s|m|h))+", value):
        total = sum(float(n) * units[u] for n, _, u in re.findall(r"(\d+(\.\d+)?)(ms|s|m|h)", value))
        if total > 0:
            return total
    raise where.error(key, f'must be a duration such as "1s" or "500ms", not {value!r}')


def _client(value: Any, where: _Where, key: str) -> list[tuple[str, str]]:
    """``client``: a path, a list of paths, or a list of [cert, key] pairs ("" key: in the cert)."""
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list):
        raise where.error(key, f"must be a path, a list of paths or of [cert, key] pairs, not {value!r}")
    pairs = []
    for item in value:
        if isinstance(item, str):
            pairs.append((where.file(item), ""))
        elif (
            isinstance(item, list)
            and 1 <= len(item) <= 2
            and all(isinstance(p, str) for p in item)
            and item[0]
        ):
            pairs.append((where.file(item[0]), where.file(item[1]) if len(item) == 2 and item[1] else ""))
        else:
            raise where.error(key, f"{item!r} is neither a path nor a [cert, key] pair")
    return pairs


def _ssl_context(
    ca: list[str], client: list[tuple[str, str]], skip_verify: bool, where: _Where, prefix: str
) -> ssl.SSLContext:
    # The system's CAs plus the configured ones, as containerd does.
    ctx = ssl.create_default_context()
    for path in ca:
        try:
            ctx.load_verify_locations(cafile=path)
        except (OSError, ssl.SSLError) as exc:
            raise where.error(
                prefix + "ca", f"{path}: not a readable PEM certificate ({_why(exc)})"
            ) from None
    for i, (cert, key) in enumerate(client):
        for path in (cert, key):
            if path and not os.path.isfile(path):
                raise where.error(prefix + "client", f"{path}: no such file")
        if i:
            continue  # Python's TLS offers one client certificate: the first pair
        try:
            ctx.load_cert_chain(cert, key or None)
        except (OSError, ssl.SSLError) as exc:
            raise where.error(
                prefix + "client", f"{cert}: not a usable certificate and key ({_why(exc)})"
            ) from None
    if skip_verify:
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    return ctx


def _why(exc: BaseException) -> str:
    return str(getattr(exc, "strerror", None) or getattr(exc, "reason", None) or exc)


def _docker_certs(directory: str) -> Namespace | None:
    """A directory in Docker's ``certs.d`` layout: ``*.crt`` CAs, ``X.cert`` + ``X.key`` pairs."""
    cas = sorted(glob.glob(os.path.join(directory, "*.crt")))
    certs = sorted(glob.glob(os.path.join(directory, "*.cert")))
    if not cas and not certs:
        return None
    where = _Where(directory, directory)
    pairs = []
    for cert in certs:
        key = cert[: -len(".cert")] + ".key"
        if not os.path.isfile(key):
            raise where.error(os.path.basename(cert), f"client certificate without its key {key}")
        pairs.append((cert, key))
    options = _Options(tls=_ssl_context(cas, pairs, False, where, ""))
    return Namespace(directory, (), "", options)
