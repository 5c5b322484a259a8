"""A host command that fails is reported with the command, how it ended and what it printed."""

from __future__ import annotations

import pytest

from backends.runv import host
from shim.cri import errors


@pytest.mark.parametrize(
    ("argv", "expect"),
    [
        (["sh", "-c", "echo oops >&2; exit 4"], "`sh -c 'echo oops >&2; exit 4'` exited with status 4: oops"),
        (["sh", "-c", "kill -SEGV $$"], "was killed by SIGSEGV: (no output)"),
        (["/nonexistent/tool"], "cannot run `/nonexistent/tool`"),
    ],
    ids=["status-and-stderr", "signal", "missing-tool"],
)
async def test_failures_say_what_failed_and_how(argv: list[str], expect: str) -> None:
    with pytest.raises(errors.InternalError) as info:
        await host.must("doing the thing", *argv)
    assert expect in info.value.message
    assert info.value.message.startswith(("doing the thing: `", "cannot run"))


async def test_success_returns_the_output() -> None:
    assert await host.must("echo", "sh", "-c", "echo out; echo err >&2") == "out\nerr"
