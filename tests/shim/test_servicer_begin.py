"""CriServicer.begin: an RPC method's plain answer settles at once, a coroutine it returns is awaited;
which one a method returns may change from call to call (begin remembers the types that are not
coroutines, to skip asyncio.iscoroutine's ABC check)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any

from cri_api import api_pb2 as pb
from shim.cri.codes import Code
from shim.cri.errors import NotFoundError
from shim.cri.servicer import CriServicer, Rpc


def _servicer() -> CriServicer:
    servicer = object.__new__(CriServicer)  # begin needs none of what a Shim gives the services
    servicer.observer = None
    return servicer


async def test_plain_answers_and_coroutines_in_turn_are_each_settled_as_they_are() -> None:
    async def later(version: str) -> pb.VersionResponse:
        await asyncio.sleep(0)
        return pb.VersionResponse(version=version)

    async def missing() -> pb.VersionResponse:
        raise NotFoundError("gone")

    answers: list[Any] = [
        pb.VersionResponse(version="now-1"),
        later("later-1"),
        b"\x0a\x05now-2",  # already serialized (a kept List answer)
        pb.VersionResponse(version="now-3"),
        later("later-2"),
        missing(),
        b"\x0a\x05now-4",
    ]
    served = iter(answers)
    rpc = Rpc("Version", pb.VersionRequest, lambda req: next(served), True)
    servicer = _servicer()
    got = []
    for _ in answers:
        outcome = servicer.begin(rpc, pb.VersionRequest())
        if isinstance(outcome, tuple):
            got.append(("now", *outcome))
        else:
            assert isinstance(outcome, Awaitable)
            got.append(("later", *(await outcome)))
    assert [(when, code, detail) for when, code, detail, _ in got] == [
        ("now", Code.OK, ""),
        ("later", Code.OK, ""),
        ("now", Code.OK, ""),
        ("now", Code.OK, ""),
        ("later", Code.OK, ""),
        ("later", Code.NOT_FOUND, "gone"),
        ("now", Code.OK, ""),
    ]
    responses = [r if isinstance(r, bytes | None) else r.version for *_, r in got]
    assert responses == ["now-1", "later-1", b"\x0a\x05now-2", "now-3", "later-2", None, b"\x0a\x05now-4"]


def test_a_polled_answer_is_observed_and_logged_at_debug_when_asked_for(monkeypatch: Any) -> None:
    """An OK polled call skips the log path only when nothing would use it: an observer (the
    metrics endpoint) still sees every call, and so does the debug log when it is on."""
    logged: list[dict[str, Any]] = []
    monkeypatch.setattr(
        "shim.cri.servicer.log", type("L", (), {"debug": lambda self, *a, **k: logged.append(k)})()
    )
    rpc = Rpc("Version", pb.VersionRequest, lambda req: b"\x0a\x01v", True)
    servicer = _servicer()

    monkeypatch.setattr("shim.cri.servicer.debug_enabled", lambda: False)
    assert servicer.begin(rpc, pb.VersionRequest()) == (Code.OK, "", b"\x0a\x01v")
    assert logged == []

    seen: list[tuple[str, str]] = []
    servicer.observer = lambda method, code, seconds: seen.append((method, code))
    assert servicer.begin(rpc, pb.VersionRequest()) == (Code.OK, "", b"\x0a\x01v")
    assert seen == [("Version", "OK")] and logged == []

    servicer.observer = None
    monkeypatch.setattr("shim.cri.servicer.debug_enabled", lambda: True)
    assert servicer.begin(rpc, pb.VersionRequest()) == (Code.OK, "", b"\x0a\x01v")
    assert [(e["method"], e["code"]) for e in logged] == [("Version", "OK")]
