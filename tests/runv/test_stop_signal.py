"""The stop signal in runv: the image config's STOPSIGNAL unless the container's config names one,
recorded for ContainerStatus and sent by StopContainer through the agent."""

from __future__ import annotations

from pathlib import Path

import pytest

from backends.runv.backend import RunvBackend
from cri_api import api_pb2 as pb
from shim.cri.messages import container_status_pb
from tests.runv.helpers import Events, MemorySink, container_record, needs_vm, sandbox_record

pytestmark = needs_vm

TRAPS = (
    "trap 'echo got-term; exit 0' TERM; trap 'echo got-usr1; exit 0' USR1; "
    "trap 'echo got-quit; exit 0' QUIT; touch /tmp/ready; sleep 3600 & wait"
)


@pytest.mark.parametrize(
    ("image", "asked", "want", "said"),
    [
        ("test/usr1:1", pb.SIGNAL_RUNTIME_DEFAULT, pb.SIGNAL_SIGUSR1, b"got-usr1\n"),
        ("test/usr1:1", pb.SIGNAL_SIGQUIT, pb.SIGNAL_SIGQUIT, b"got-quit\n"),
        ("test/busybox:1", pb.SIGNAL_RUNTIME_DEFAULT, pb.SIGNAL_SIGTERM, b"got-term\n"),
    ],
    ids=["image-stopsignal", "config-over-image", "default-term"],
)
async def test_the_reported_stop_signal_is_the_one_sent(
    runv: tuple[RunvBackend, Events], busybox_rootfs: Path, image: str, asked: int, want: int, said: bytes
) -> None:
    backend, events = runv
    backend.image_store.import_dir("test/usr1:1", str(busybox_rootfs), {"StopSignal": "SIGUSR1"})
    sb = sandbox_record("stops")
    await backend.lifecycle.run_sandbox(sb)
    ct = container_record(sb, image, ["sh", "-c", TRAPS], stop_signal=asked)
    await backend.lifecycle.create_container(ct, sb)
    assert container_status_pb(ct).stop_signal == want
    sink = MemorySink()
    await events.start(backend.lifecycle, ct, sb, sink)
    await backend.exec.exec_sync(ct, ["sh", "-c", "until [ -e /tmp/ready ]; do sleep 0.05; done"])
    info = await backend.lifecycle.stop_container(ct, 30)
    assert info.exit_code == 0
    await sink.closed.wait()
    assert bytes(sink.data["stdout"]) == said
    await backend.lifecycle.remove_container(ct)
    await backend.lifecycle.stop_sandbox(sb)
    await backend.lifecycle.remove_sandbox(sb)
