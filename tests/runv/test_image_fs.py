"""ImageFsInfo on runv: its image store and its containers' writable layers, apart."""

from __future__ import annotations

import os

from backends.runv.backend import RunvBackend
from tests.runv.helpers import Events, MemorySink, container_record, needs_vm, sandbox_record

pytestmark = needs_vm


async def test_image_fs_info_names_the_image_store_and_the_writable_layers_apart(
    runv: tuple[RunvBackend, Events],
) -> None:
    """runv's two stores are directories of their own: the kubelet may find them on one disk or
    two (it compares the devices); each list names one, with what it holds."""
    backend, events = runv
    sb = sandbox_record("fs")
    await backend.lifecycle.run_sandbox(sb)
    ct = container_record(sb, "test/busybox:1", ["sh", "-c", "head -c 4194304 /dev/zero > /big; sleep 3600"])
    await backend.lifecycle.create_container(ct, sb)
    await events.start(backend.lifecycle, ct, sb, MemorySink())
    await backend.exec.exec_sync(ct, ["sh", "-c", "until [ $(wc -c < /big) = 4194304 ]; do sleep 0.05; done"])
    fs = await backend.images.image_fs_info()
    (images,), (writable,) = fs.image_filesystems, fs.container_filesystems
    assert images.fs_id.mountpoint != writable.fs_id.mountpoint
    assert os.path.isdir(images.fs_id.mountpoint) and os.path.isdir(writable.fs_id.mountpoint)
    assert images.used_bytes.value > 0 and writable.inodes_used.value > 0
    await backend.lifecycle.stop_sandbox(sb)
    await backend.lifecycle.remove_sandbox(sb)
