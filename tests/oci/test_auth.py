"""Credentials and auth flows (backends/oci/auth.py) against stand-in registries: Basic, the
Bearer token flow with user and password, an identity (refresh) token, a registry token, the
node-wide credentials file, the token cache, which host gets which credentials, and that no
secret reaches a log line or an error message."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import structlog

from backends import reference
from backends.oci.auth import Credentials, CredentialsFileError, TokenCache, parse_challenge
from backends.oci.registry import PullError, RegistryClient
from backends.oci.settings import PullSettings
from tests.oci.conftest import REPO, HostsDir, toml_str
from tests.oci.standin import Image, Pki, Standin

PASSWORD = "secret-password"


@pytest.fixture(params=["basic", "bearer"])
def guarded(request: pytest.FixtureRequest, image: Image) -> Iterator[Standin]:
    with Standin(auth=request.param) as reg:
        reg.put(REPO, "v1", image)
        yield reg


def settings_for(reg: Standin, **more: Any) -> PullSettings:
    return PullSettings(insecure=frozenset({reg.netloc}), **more)


def manifest(reg: Standin, creds: Credentials | None, settings: PullSettings | None = None) -> bytes:
    ref = reference.parse(f"{reg.netloc}/{REPO}:v1")
    return RegistryClient(ref, creds, settings or settings_for(reg)).manifest("v1")[0]


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


CRI_CREDENTIALS = [
    ("username-password", Credentials(username="user", password=PASSWORD)),
    ("auth", Credentials(auth=b64(f"user:{PASSWORD}"))),
]


@pytest.mark.parametrize("creds", [c for _, c in CRI_CREDENTIALS], ids=[i for i, _ in CRI_CREDENTIALS])
def test_user_and_password_flows(guarded: Standin, image: Image, creds: Credentials) -> None:
    assert manifest(guarded, creds) == image.manifest
    if guarded.auth == "bearer":
        (req,) = guarded.token_requests
        assert req.method == "GET" and req.query == {"service": "standin", "scope": f"repository:{REPO}:pull"}
        assert req.header("authorization") == "Basic " + b64(f"user:{PASSWORD}")
    else:
        assert guarded.token_requests == []
    assert guarded.api_requests()[-1].header("authorization").split()[0].lower() == guarded.auth


def test_wrong_password_is_refused(guarded: Standin) -> None:
    refusal = (
        "token request failed: HTTP 401" if guarded.auth == "bearer" else "refused the user name and password"
    )
    with pytest.raises(PullError, match=refusal):
        manifest(guarded, Credentials(username="user", password="wrong"))


def test_no_credentials_for_a_registry_that_wants_them(guarded: Standin) -> None:
    with pytest.raises(PullError, match=r"token request failed|there are none for it"):
        manifest(guarded, None)


def test_identity_token_is_exchanged_at_the_realm(image: Image) -> None:
    with Standin(auth="bearer") as reg:
        reg.put(REPO, "v1", image)
        assert manifest(reg, Credentials(identity_token="secret-refresh-token")) == image.manifest
        (req,) = reg.token_requests
        assert req.method == "POST" and req.header("authorization") == ""
        assert reg.api_requests()[-1].header("authorization") == "Bearer tok-1"


def test_registry_token_is_used_as_is(image: Image) -> None:
    with Standin(auth="bearer") as reg:
        reg.put(REPO, "v1", image)
        assert manifest(reg, Credentials(registry_token="secret-registry-token")) == image.manifest
        assert reg.token_requests == []
        assert [s.header("authorization") for s in reg.api_requests()] == ["Bearer secret-registry-token"]


def test_token_is_cached_across_pulls_for_its_lifetime(image: Image) -> None:
    with Standin(auth="bearer") as reg:
        reg.put(REPO, "v1", image)
        settings = settings_for(reg)
        creds = Credentials(username="user", password=PASSWORD)
        manifest(reg, creds, settings)
        manifest(reg, creds, settings)  # another pull: the token of the first, without a 401
        assert len(reg.token_requests) == 1
        assert [s.header("authorization") for s in reg.api_requests()] == ["", "Bearer tok-1", "Bearer tok-1"]
        reg.issued.clear()  # revoked: the next pull's cached token gets a 401, and a new one
        manifest(reg, creds, settings)
        assert len(reg.token_requests) == 2


def test_token_cache_expiry() -> None:
    now = [100.0]
    cache = TokenCache(clock=lambda: now[0])
    key = ("host", "realm", "svc", "scope", "fp")
    cache.put(key, "t", 60, ("host", "repo", "fp"))
    now[0] += 53  # within expires_in, less the margin (a tenth, at most 30 s)
    assert cache.get(key) == "t" and cache.last(("host", "repo", "fp")) == "t"
    now[0] += 2
    assert cache.get(key) == "" and cache.last(("host", "repo", "fp")) == ""


def test_parse_challenge() -> None:
    scheme, params = parse_challenge(
        'Bearer realm="https://a/token",service="reg",scope="repository:x/y:pull,push"'
    )
    assert scheme == "bearer"
    assert params == {"realm": "https://a/token", "service": "reg", "scope": "repository:x/y:pull,push"}
    assert parse_challenge('Basic realm="r"') == ("basic", {"realm": "r"})


# --------------------------------------------------------------------------- the credentials file


def write_config(path: Path, auths: dict[str, Any]) -> str:
    path.write_text(json.dumps({"auths": auths}))
    return str(path)


CREDENTIAL_ENTRIES = [
    ("auth", {"auth": b64(f"user:{PASSWORD}")}),
    ("username-password", {"username": "user", "password": PASSWORD}),
    ("identitytoken", {"identitytoken": "secret-refresh-token"}),
]


@pytest.mark.parametrize("entry", [e for _, e in CREDENTIAL_ENTRIES], ids=[i for i, _ in CREDENTIAL_ENTRIES])
def test_credentials_file_serves_hosts_the_request_has_nothing_for(
    image: Image, tmp_path: Path, entry: dict[str, str]
) -> None:
    with Standin(auth="bearer") as reg:
        reg.put(REPO, "v1", image)
        path = write_config(tmp_path / "config.json", {f"https://{reg.netloc}/v1/": entry})
        assert manifest(reg, None, settings_for(reg, credentials_file=path)) == image.manifest
        assert len(reg.issued) == 1


def test_the_request_s_credentials_win_over_the_file(image: Image, tmp_path: Path) -> None:
    with Standin(auth="basic") as reg:
        reg.put(REPO, "v1", image)
        path = write_config(tmp_path / "config.json", {reg.netloc: {"username": "user", "password": "stale"}})
        settings = settings_for(reg, credentials_file=path)
        assert manifest(reg, Credentials(username="user", password=PASSWORD), settings) == image.manifest
        with pytest.raises(PullError, match="refused the user name and password"):
            manifest(reg, None, settings)
        # The file is read again when it changes.
        write_config(
            tmp_path / "config.json", {reg.netloc: {"username": "user", "password": PASSWORD, "x": 1}}
        )
        assert manifest(reg, None, settings) == image.manifest


BAD_FILES = [
    ("not-json", "{", "not JSON"),
    ("auths-type", '{"auths": []}', 'key "auths" must be an object'),
    ("entry-type", '{"auths": {"r.example": "x"}}', 'key auths."r.example": must be an object'),
    (
        "field-type",
        '{"auths": {"r.example": {"password": 5}}}',
        'auths."r.example".password: must be a string',
    ),
    (
        "auth-not-base64",
        '{"auths": {"r.example": {"auth": "s3cr3t-not-b64!"}}}',
        "auth: not base64 of user:password",
    ),
]


@pytest.mark.parametrize(
    ("text", "message"), [(t, m) for _, t, m in BAD_FILES], ids=[i for i, _, _ in BAD_FILES]
)
def test_bad_credentials_file_fails_at_start(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "config.json"
    path.write_text(text)
    with pytest.raises(CredentialsFileError) as err:
        PullSettings(credentials_file=str(path))
    assert str(err.value).startswith(f"{path}: ") and message in str(err.value)
    assert "s3cr3t" not in str(err.value)


# --------------------------------------------------------------------------- which host gets what


def test_request_credentials_for_the_registry_are_not_sent_to_a_mirror(
    image: Image, pki: Pki, hosts_dir: HostsDir
) -> None:
    with Standin(auth="basic") as upstream, Standin(pki, auth="basic") as mirror:
        upstream.put(REPO, "v1", image)
        mirror.put(REPO, "v1", image)
        hosts_dir.write(upstream.netloc, f'[host."{mirror.url}"]\nca = {toml_str(pki.ca)}\n')
        settings = settings_for(upstream, config_path=hosts_dir.path)
        creds = Credentials(username="user", password=PASSWORD, server_address=upstream.netloc)
        with structlog.testing.capture_logs() as logs:
            assert manifest(upstream, creds, settings) == image.manifest
        assert all(s.header("authorization") == "" for s in mirror.api_requests())
        (failed,) = [e for e in logs if e["event"] == "registry.host_failed"]
        assert failed["host"] == mirror.url and "there are none for it" in failed["reason"]
        # Credentials for no particular registry go to every host of the pull, mirrors first.
        assert manifest(upstream, Credentials(username="user", password=PASSWORD), settings) == image.manifest
        assert mirror.api_requests()[-1].header("authorization").startswith("Basic ")


def test_no_secret_in_logs_or_errors(image: Image, pki: Pki, hosts_dir: HostsDir, tmp_path: Path) -> None:
    secrets = {PASSWORD, "secret-refresh-token", "secret-registry-token", "file-secret"}
    secrets |= {b64(f"user:{PASSWORD}"), b64(f"user:wrong-{PASSWORD}"), b64("u:file-secret")}
    messages: list[str] = []
    with Standin(auth="bearer") as upstream, Standin(pki, auth="basic") as mirror:
        upstream.put(REPO, "v1", image)
        hosts_dir.write(upstream.netloc, f'[host."{mirror.url}"]\nca = {toml_str(pki.ca)}\n')
        path = write_config(
            tmp_path / "config.json", {mirror.netloc: {"username": "u", "password": "file-secret"}}
        )
        settings = settings_for(upstream, config_path=hosts_dir.path, credentials_file=path)
        attempts = [
            Credentials(username="user", password=PASSWORD, server_address=upstream.netloc),
            Credentials(auth=b64(f"user:{PASSWORD}"), server_address=upstream.netloc),
            Credentials(identity_token="secret-refresh-token", server_address=upstream.netloc),
            Credentials(registry_token="secret-registry-token", server_address=upstream.netloc),
            Credentials(username="user", password="wrong-" + PASSWORD),
            Credentials(registry_token="bad\nsecret-registry-token"),
        ]
        with structlog.testing.capture_logs() as logs:
            for creds in attempts:
                messages.append(repr(creds))
                try:
                    manifest(upstream, creds, settings)
                except PullError as exc:
                    messages.append(str(exc))
    assert any("token request failed" in m for m in messages)  # the failures did happen
    assert len([e for e in logs if e["event"] == "registry.host_failed"]) >= len(attempts)
    text = "\n".join([*messages, *(repr(e) for e in logs)])
    leaked = [s for s in secrets if s in text] + [
        t for t in upstream.issued if f"'{t}'" in text or f" {t}" in text
    ]
    assert leaked == []
