"""The stop signal on the real engine: the image's STOPSIGNAL unless the config names one; what
ContainerStatus reports is what the engine sends."""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from pathlib import Path

import docker
import pytest

from backends.contract import recorded_stop_signal
from cri_api import api_pb2 as pb
from shim.cri.container_io import CriLogWriter
from tests.docker.dockerkit import BUSYBOX, Harness, container_record

pytestmark = pytest.mark.docker

# SIGRTMIN+3 by its number (37 with glibc, as the engine and the shim count): busybox's trap knows
# no RT names.
TRAPS = (
    "trap 'echo got-term; exit 0' TERM; trap 'echo got-usr1; exit 0' USR1; "
    "trap 'echo got-rtmin3; exit 0' 37; touch /tmp/ready; sleep 3600 & wait"
)


@pytest.fixture
def usr1_image(engine: docker.APIClient) -> Iterator[str]:
    """busybox with STOPSIGNAL SIGUSR1 in its config, made here (commit) and removed after."""
    repo, tag = "cri-shim-test/stopsignal", f"t{os.getpid()}-{secrets.token_hex(3)}"
    made = engine.create_container(BUSYBOX, command=["true"])
    try:
        engine.commit(made["Id"], repository=repo, tag=tag, conf={"StopSignal": "SIGUSR1"})
    finally:
        engine.remove_container(made["Id"], force=True)
    ref = f"{repo}:{tag}"
    yield ref
    engine.remove_image(ref, force=True)


@pytest.mark.parametrize(
    ("image_has", "asked", "want", "said"),
    [
        (True, pb.SIGNAL_RUNTIME_DEFAULT, pb.SIGNAL_SIGUSR1, "got-usr1"),
        (True, pb.SIGNAL_SIGRTMINPLUS3, pb.SIGNAL_SIGRTMINPLUS3, "got-rtmin3"),
        (False, pb.SIGNAL_RUNTIME_DEFAULT, pb.SIGNAL_SIGTERM, "got-term"),
    ],
    ids=["image-stopsignal", "config-over-image", "default-term"],
)
async def test_the_reported_stop_signal_is_the_one_the_engine_sends(
    harness: Harness, usr1_image: str, tmp_path: Path, image_has: bool, asked: int, want: int, said: str
) -> None:
    image = usr1_image if image_has else BUSYBOX
    sb = await harness.run_sandbox()
    ct = container_record(sb, ["sh", "-c", TRAPS], stop_signal=asked)
    ct.config.image.image = ct.image_name = image
    await harness.create(ct, sb)
    assert recorded_stop_signal(ct) == want
    info = harness.engine.inspect_container(ct.backend_data["engine_id"])
    assert info["Config"]["StopSignal"] == pb.Signal.Name(want).removeprefix("SIGNAL_").replace("PLUS", "+")
    log = tmp_path / "c.log"
    await harness.events.start(harness.backend.lifecycle, ct, sb, CriLogWriter(str(log)))
    ready = ["sh", "-c", "until [ -e /tmp/ready ]; do sleep 0.05; done"]
    await harness.backend.exec.exec_sync(ct, ready)
    exit_info = await harness.backend.lifecycle.stop_container(ct, 30)
    assert exit_info.exit_code == 0
    await harness.events.exit_of(ct.id)
    assert [line.rsplit(" ", 1)[-1] for line in log.read_text().splitlines()] == [said]
