"""What a backend's runtime config means, read once for every backend (backends.contract)."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from backends.contract import InvalidArgumentError, host_signal, image_user, seccomp_of
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


def test_seccomp_is_read_once_for_every_backend(tmp_path: Path) -> None:
    good = tmp_path / "p.json"
    good.write_text('{"defaultAction": "SCMP_ACT_ALLOW"}')
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2]")
    local = pb.SecurityProfile(profile_type=pb.SecurityProfile.Localhost, localhost_ref=str(good))
    assert seccomp_of(None).kind == "unconfined"  # nothing asked for, as containerd
    assert seccomp_of(local, privileged=True).kind == "unconfined"
    assert seccomp_of(pb.SecurityProfile(profile_type=pb.SecurityProfile.RuntimeDefault)).kind == "default"
    assert seccomp_of(None, "runtime/default").kind == "default"
    assert seccomp_of(local).profile == good.read_text()
    assert seccomp_of(None, f"localhost/{good}").kind == "localhost"
    for wrong in (f"localhost/{bad}", f"localhost/{tmp_path}/missing.json", "bogus"):
        with pytest.raises(InvalidArgumentError):
            seccomp_of(None, wrong)
