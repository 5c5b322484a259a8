"""What a backend's runtime config means, read once for every backend (backends.contract)."""

from __future__ import annotations

import signal

import pytest

from backends.contract import host_signal, image_user
from cri_api import api_pb2 as pb


@pytest.mark.parametrize(
    ("user", "want"),
    [("", (None, "")), ("1002", (1002, "")), ("www-data", (None, "www-data")), ("1003:1004", (1003, ""))],
    ids=["none", "uid", "name", "uid-gid"],
)
def test_image_user(user: str, want: tuple[int | None, str]) -> None:
    assert image_user(user) == want


@pytest.mark.parametrize(
    ("cri", "want"),
    [(pb.RUNTIME_DEFAULT, None), (pb.SIGKILL, signal.SIGKILL), (pb.SIGUSR1, signal.SIGUSR1), (9999, None)],
    ids=["runtime-default", "kill", "usr1", "unknown"],
)
def test_a_stop_signal_is_the_host_signal_the_cri_names(cri: int, want: signal.Signals | None) -> None:
    assert host_signal(cri) is want
