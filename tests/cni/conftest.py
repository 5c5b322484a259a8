"""Fixtures of the CNI client tests: a config directory, fake plugins, a cache, a client over them."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import pytest

from backends.cni import CniClient, CniSettings
from tests.cni import fakeplugin

REAL_MARKER = "cni_plugins"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", f"{REAL_MARKER}: runs Debian's CNI plugins as root (skipped without; a failure in CI)"
    )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):  # type: ignore[no-untyped-def]
    """In CI (CI=true) a skipped real-plugin test is a failure: scripts/testenv/up installs them."""
    outcome = yield
    report = outcome.get_result()
    if report.skipped and os.environ.get("CI") == "true" and item.get_closest_marker(REAL_MARKER):
        report.outcome = "failed"
        report.longrepr = f"{REAL_MARKER} test skipped in CI: {report.longrepr}"


@dataclasses.dataclass
class Env:
    root: Path

    @property
    def conf_dir(self) -> Path:
        return self.root / "net.d"

    @property
    def bin_dir(self) -> Path:
        return self.root / "bin"

    @property
    def cache_dir(self) -> Path:
        return self.root / "cache"

    @property
    def log(self) -> Path:
        return self.root / "calls.jsonl"

    def client(self, **settings: Any) -> CniClient:
        base: dict[str, Any] = {
            "conf_dir": str(self.conf_dir),
            "bin_dirs": (str(self.bin_dir),),
            "cache_dir": str(self.cache_dir),
            "plugin_timeout": 20.0,
        }
        return CniClient(CniSettings(**(base | settings)))

    def plugins(self, *names: str) -> None:
        fakeplugin.install(self.bin_dir, *names)

    def plugin(self, type_: str, **fake: object) -> dict[str, Any]:
        return fakeplugin.plugin(type_, self.log, **fake)

    def write(self, obj: object, name: str = "10-test.conflist") -> Path:
        return fakeplugin.write_json(self.conf_dir / name, obj)

    def calls(self) -> list[dict[str, Any]]:
        return fakeplugin.calls(self.log)


@pytest.fixture
def env(tmp_path: Path) -> Env:
    return Env(tmp_path)
