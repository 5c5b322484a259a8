"""Registry credentials and the distribution API's auth challenges.

Where a host's credentials come from, first found:

1. the CRI ``AuthConfig`` of the pull, for the image's registry and for a mirror only when its
   ``server_address`` names that mirror (or is empty: then for every host of the pull);
2. the node-wide credentials file (docker's config.json, as the kubelet reads it) by host;
3. none (anonymous; a Bearer realm may still hand out a token).

A ``Basic`` challenge is answered with user name and password (or ``auth``); a ``Bearer``
challenge with a token from its realm: a GET with Basic credentials (or none), or, for an
``identity_token`` (an OAuth2 refresh token), a POST of ``grant_type=refresh_token``. A
``registry_token`` is sent as the bearer token as it is. Tokens are cached per host, realm,
service, scope and credentials for their ``expires_in``.

No secret reaches a log line or an error message: :class:`Credentials` hides its secrets from
``repr``, and errors name hosts, realms and HTTP statuses only.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import hashlib
import json
import os
import re
import threading
import time
import urllib.parse
from collections.abc import Callable
from typing import Any

import structlog

from backends.oci.hosts import RegistryHost
from backends.oci.transport import PullError, Transport, TransportError, safe_url

log = structlog.get_logger("cri-shim.oci.auth")

DEFAULT_EXPIRES_IN = 60  # seconds, when the token endpoint does not say (the distribution spec's)
_DOCKER_HUB_NAMES = {"docker.io", "index.docker.io", "registry-1.docker.io"}


class AuthError(PullError):
    """The host refused the credentials, or its auth flow failed."""


class CredentialsFileError(ValueError):
    """The credentials file cannot be used; the message names the file and the entry, never a value."""


@dataclasses.dataclass(frozen=True, slots=True)
class Credentials:
    username: str = ""
    password: str = dataclasses.field(default="", repr=False)
    auth: str = dataclasses.field(default="", repr=False)  # base64 of user:password
    identity_token: str = dataclasses.field(default="", repr=False)  # an OAuth2 refresh token
    registry_token: str = dataclasses.field(default="", repr=False)  # a bearer token, sent as is
    server_address: str = ""  # the registry they are for ("" = any host of the pull)

    @property
    def empty(self) -> bool:
        return not (self.username or self.password or self.auth or self.identity_token or self.registry_token)

    def basic(self) -> str:
        """The Basic Authorization value, or "" without a user name and password."""
        if self.auth:
            return f"Basic {self.auth}"
        if self.username:
            raw = f"{self.username}:{self.password}".encode()
            return f"Basic {base64.b64encode(raw).decode()}"
        return ""

    def fingerprint(self) -> str:
        """Tells credentials apart in the token cache without keeping them in its keys."""
        secret = "\0".join(
            (self.username, self.password, self.auth, self.identity_token, self.registry_token)
        )
        return hashlib.sha256(secret.encode()).hexdigest()[:32]


def registry_key(address: str) -> str:
    """``https://index.docker.io/v1/``, ``registry-1.docker.io`` -> ``docker.io``; any other
    address -> its host[:port], lower-case."""
    rest = address.split("://", 1)[-1]
    host = rest.split("/", 1)[0].lower()
    return "docker.io" if host in _DOCKER_HUB_NAMES else host


class CredentialsFile:
    """A docker config.json (``{"auths": {"host": {"auth"|"username"/"password"|
    "identitytoken"|"registrytoken"}}}``), read at start (errors raised) and again when it changes
    (errors logged, the entries read before kept)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._stamp: tuple[int, int] | None = None
        self._entries: dict[str, Credentials] = {}
        if path:
            self._refresh(strict=True)

    def lookup(self, address: str) -> Credentials | None:
        if not self.path:
            return None
        self._refresh(strict=False)
        with self._lock:
            return self._entries.get(registry_key(address))

    def _refresh(self, strict: bool) -> None:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            stamp = None
        except OSError as exc:
            self._fail(f"{self.path}: cannot read: {exc.strerror}", strict)
            return
        else:
            stamp = (st.st_mtime_ns, st.st_size)
        with self._lock:
            if stamp == self._stamp and (stamp is not None or not strict):
                return
        try:
            entries = _parse_credentials(self.path) if stamp is not None else {}
        except CredentialsFileError as exc:
            self._fail(str(exc), strict)
            return
        with self._lock:
            self._entries, self._stamp = entries, stamp

    @staticmethod
    def _fail(message: str, strict: bool) -> None:
        if strict:
            raise CredentialsFileError(message)
        log.warning(
            "registry.credentials_file_unusable", reason=message, note="the entries read before are kept"
        )


def _parse_credentials(path: str) -> dict[str, Credentials]:
    try:
        with open(path, "rb") as fh:
            doc = json.load(fh)
    except (OSError, ValueError) as exc:
        why = exc.strerror if isinstance(exc, OSError) else "not JSON"
        raise CredentialsFileError(f"{path}: {why}") from None
    auths = doc.get("auths", {}) if isinstance(doc, dict) else None
    if not isinstance(auths, dict):
        raise CredentialsFileError(f'{path}: key "auths" must be an object of registry -> credentials')
    entries: dict[str, Credentials] = {}
    for address, entry in auths.items():
        where = f'{path}: key auths."{address}"'
        if not isinstance(entry, dict):
            raise CredentialsFileError(f"{where}: must be an object")
        fields: dict[str, str] = {}
        for name, field in (
            ("auth", "auth"),
            ("username", "username"),
            ("password", "password"),
            ("identitytoken", "identity_token"),
            ("registrytoken", "registry_token"),
        ):
            value = entry.get(name, "")
            if not isinstance(value, str):
                raise CredentialsFileError(f"{where}.{name}: must be a string")
            fields[field] = value
        if fields["auth"]:
            try:
                decoded = base64.b64decode(fields["auth"], validate=True).decode()
            except (binascii.Error, UnicodeDecodeError):
                raise CredentialsFileError(f"{where}.auth: not base64 of user:password") from None
            if ":" not in decoded:
                raise CredentialsFileError(f"{where}.auth: not base64 of user:password")
        entries[registry_key(address)] = Credentials(server_address=address, **fields)
    return entries


# --------------------------------------------------------------------------- challenges and tokens


def parse_challenge(header: str) -> tuple[str, dict[str, str]]:
    """(scheme in lower case, parameters) of the first challenge of a WWW-Authenticate."""
    scheme, _, rest = header.strip().partition(" ")
    params = {
        k.lower(): (quoted if quoted or not bare else bare)
        for k, quoted, bare in re.findall(r'(\w+)=(?:"([^"]*)"|([^,\s]*))', rest)
    }
    return scheme.lower(), params


class TokenCache:
    """Bearer tokens by (host, realm, service, scope, credentials), until they expire; and which
    key a host and repository used last, so that a pull after another skips the 401."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._tokens: dict[tuple[str, ...], tuple[str, float]] = {}
        self._last: dict[tuple[str, str, str], tuple[str, ...]] = {}

    def get(self, key: tuple[str, ...]) -> str:
        with self._lock:
            token, until = self._tokens.get(key, ("", 0.0))
            if token and until <= self._clock():
                del self._tokens[key]
                return ""
            return token

    def put(self, key: tuple[str, ...], token: str, expires_in: float, repo: tuple[str, str, str]) -> None:
        # Renewed a little before the registry would refuse it.
        margin = min(30.0, expires_in / 10)
        with self._lock:
            self._tokens[key] = (token, self._clock() + expires_in - margin)
            self._last[repo] = key

    def last(self, repo: tuple[str, str, str]) -> str:
        with self._lock:
            key = self._last.get(repo)
        return self.get(key) if key is not None else ""

    def drop(self, token: str) -> None:
        with self._lock:
            for key in [k for k, (t, _) in self._tokens.items() if t == token]:
                del self._tokens[key]


class Authorizer:
    """The Authorization of each host of one pull (of repository ``path`` of ``domain``)."""

    def __init__(
        self,
        path: str,
        domain: str,
        creds: Credentials | None,
        credentials_file: CredentialsFile,
        tokens: TokenCache,
        transport: Transport,
    ) -> None:
        self.path = path
        self.domain = domain
        self.creds = creds or Credentials()
        self.file = credentials_file
        self.tokens = tokens
        self.transport = transport
        self._lock = threading.Lock()
        self._headers: dict[str, str] = {}

    def creds_for(self, host: RegistryHost) -> Credentials:
        names = (
            {registry_key(host.netloc)}
            if host.mirror
            else {registry_key(host.netloc), registry_key(self.domain)}
        )
        if not self.creds.empty and (
            not self.creds.server_address or registry_key(self.creds.server_address) in names
        ):
            return self.creds
        found = self.file.lookup(host.netloc)
        if found is None and not host.mirror:
            found = self.file.lookup(self.domain)
        return found or Credentials()

    def header(self, host: RegistryHost) -> str:
        """What to send as Authorization to ``host`` ("" = nothing yet)."""
        with self._lock:
            if host.netloc in self._headers:
                return self._headers[host.netloc]
        creds = self.creds_for(host)
        value = f"Bearer {creds.registry_token}" if creds.registry_token else ""
        if not value:
            token = self.tokens.last((host.netloc, self.path, creds.fingerprint()))
            value = f"Bearer {token}" if token else ""
        with self._lock:
            return self._headers.setdefault(host.netloc, value)

    def unauthorized(self, host: RegistryHost, challenge: str, sent: str) -> None:
        """Answer a 401 to a request that carried ``sent``; AuthError when there is no better
        Authorization to try."""
        creds = self.creds_for(host)
        if sent.startswith("Bearer "):
            self.tokens.drop(sent[len("Bearer ") :])  # revoked or expired early
        scheme, params = parse_challenge(challenge)
        if scheme == "basic":
            value = creds.basic()
            if not value:
                raise AuthError("the registry asks for a user name and password, and there are none for it")
            if value == sent:
                raise AuthError("the registry refused the user name and password (HTTP 401)")
        elif scheme == "bearer":
            if creds.registry_token and sent == f"Bearer {creds.registry_token}":
                raise AuthError("the registry refused the registry token (HTTP 401)")
            value = f"Bearer {self._token(host, params, creds)}"
            if value == sent:
                raise AuthError("the registry refused the token its realm issued (HTTP 401)")
        else:
            raise AuthError(f"unsupported auth challenge {scheme or '(none)'!r} (HTTP 401)")
        with self._lock:
            self._headers[host.netloc] = value

    def _token(self, host: RegistryHost, params: dict[str, str], creds: Credentials) -> str:
        realm = params.get("realm", "")
        parts = urllib.parse.urlsplit(realm)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise AuthError("bearer challenge without a usable realm")
        service = params.get("service", "")
        scope = params.get("scope") or f"repository:{self.path}:pull"
        key = (host.netloc, realm, service, scope, creds.fingerprint())
        token = self.tokens.get(key)  # another pull's (the one refused was dropped above)
        if token:
            return token
        # The realm may be another host: it is reached with this host's TLS settings (its CAs
        # and the system's), and the credentials go to it alone (not to its redirects).
        realm_host = dataclasses.replace(host, url=safe_url(realm), scheme=parts.scheme, netloc=parts.netloc)
        headers = [("Accept", "application/json")]
        if creds.identity_token:
            form = {
                "grant_type": "refresh_token",
                "refresh_token": creds.identity_token,
                "service": service,
                "scope": scope,
                "client_id": "cri-shim",
            }
            body: bytes | None = urllib.parse.urlencode(form).encode()
            headers.append(("Content-Type", "application/x-www-form-urlencoded"))
            method, url, private = "POST", realm, []
        else:
            query = urllib.parse.urlencode({k: v for k, v in (("service", service), ("scope", scope)) if v})
            sep = "&" if parts.query else "?"
            method, url, body = "GET", f"{realm}{sep}{query}", None
            basic = creds.basic()
            private = [("Authorization", basic)] if basic else []
        try:
            reply = self.transport.request(
                realm_host, url, headers, method=method, body=body, private=private
            )
            try:
                status = reply.status
                data = reply.read_all(1 << 20, self.transport.progress_timeout) if status == 200 else b""
            finally:
                reply.close()
        except TransportError as exc:
            raise AuthError(f"token request failed: {exc} from {safe_url(realm)}") from None
        if status != 200:
            raise AuthError(f"token request failed: HTTP {status} from {safe_url(realm)}")
        answer = _json_object(data)
        token = str(answer.get("token") or answer.get("access_token") or "")
        if not token:
            raise AuthError(f"token request failed: no token in the answer of {safe_url(realm)}")
        try:
            expires_in = max(float(answer.get("expires_in") or DEFAULT_EXPIRES_IN), 1.0)
        except (TypeError, ValueError):
            expires_in = DEFAULT_EXPIRES_IN
        self.tokens.put(key, token, expires_in, (host.netloc, self.path, creds.fingerprint()))
        return token


def _json_object(data: bytes) -> dict[str, Any]:
    try:
        value = json.loads(data)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}
