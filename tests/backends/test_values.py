"""What a backend's runtime config means, read once for every backend (backends.contract)."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from backends.contract import (
    ContainerRecord,
    cri_signal,
    decide_stop_signal,
    host_signal,
    image_user,
    recorded_stop_signal,
    seccomp_of,
    signal_name,
)
from backends.contract.errors import InvalidArgumentError
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
    [
        (pb.SIGNAL_RUNTIME_DEFAULT, None),
        (pb.SIGNAL_SIGKILL, signal.SIGKILL),
        (pb.SIGNAL_SIGUSR1, signal.SIGUSR1),
        (pb.SIGNAL_SIGRTMIN, signal.SIGRTMIN),
        (pb.SIGNAL_SIGRTMINPLUS3, signal.SIGRTMIN + 3),
        (pb.SIGNAL_SIGRTMAXMINUS1, signal.SIGRTMAX - 1),
        (9999, None),
    ],
    ids=["runtime-default", "kill", "usr1", "rtmin", "rtmin+3", "rtmax-1", "unknown"],
)
def test_a_stop_signal_is_the_host_signal_the_cri_names(cri: int, want: int | None) -> None:
    assert host_signal(cri) == want


@pytest.mark.parametrize(
    ("text", "want", "name"),
    [
        ("SIGQUIT", pb.SIGNAL_SIGQUIT, "SIGQUIT"),
        ("quit", pb.SIGNAL_SIGQUIT, "SIGQUIT"),
        ("3", pb.SIGNAL_SIGQUIT, "SIGQUIT"),
        ("6", pb.SIGNAL_SIGABRT, "SIGABRT"),  # the first of aliases (SIGIOT)
        ("SIGRTMIN+3", pb.SIGNAL_SIGRTMINPLUS3, "SIGRTMIN+3"),
        ("rtmax-1", pb.SIGNAL_SIGRTMAXMINUS1, "SIGRTMAX-1"),
        ("64", pb.SIGNAL_SIGRTMAX, "SIGRTMAX"),
        ("", pb.SIGNAL_RUNTIME_DEFAULT, ""),
        ("SIGBOGUS", pb.SIGNAL_RUNTIME_DEFAULT, ""),
        ("SIGRTMIN+16", pb.SIGNAL_RUNTIME_DEFAULT, ""),
        ("65", pb.SIGNAL_RUNTIME_DEFAULT, ""),
    ],
    ids=["name", "short", "number", "alias", "rt", "rt-short", "rt-number", "none", "bogus", "beyond", "big"],
)
def test_an_image_stopsignal_is_read_as_the_cri_signal(text: str, want: int, name: str) -> None:
    assert cri_signal(text) == want
    assert signal_name(want) == name  # what the Docker Engine is given


@pytest.mark.parametrize(
    ("config", "image", "want"),
    [
        (pb.SIGNAL_SIGUSR1, "SIGQUIT", pb.SIGNAL_SIGUSR1),
        (pb.SIGNAL_RUNTIME_DEFAULT, "SIGQUIT", pb.SIGNAL_SIGQUIT),
        (pb.SIGNAL_RUNTIME_DEFAULT, "", pb.SIGNAL_SIGTERM),
        (pb.SIGNAL_RUNTIME_DEFAULT, "SIGBOGUS", pb.SIGNAL_SIGTERM),
        (9999, "", pb.SIGNAL_SIGTERM),
    ],
    ids=["config", "image", "default", "bad-image", "bad-config"],
)
def test_the_stop_signal_is_the_configs_else_the_images_else_term(config: int, image: str, want: int) -> None:
    record = ContainerRecord("c", "s", "b", pb.ContainerConfig(stop_signal=config), 1, "")  # type: ignore[arg-type]
    assert recorded_stop_signal(record) == (config if config in (pb.SIGNAL_SIGUSR1,) else pb.SIGNAL_SIGTERM)
    assert decide_stop_signal(record, image) == want
    assert recorded_stop_signal(record) == want  # kept in the record, which the shim persists
    assert record.stop_signal == want and record.backend_data == {}


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
