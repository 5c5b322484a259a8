"""SupplementalGroupsPolicy in runv: Merge adds the image's groups of the user, Strict does not."""

from __future__ import annotations

from pathlib import Path

from backends.contract import Capability
from backends.runv.backend import RunvBackend
from cri_api import api_pb2 as pb
from tests.runv.helpers import Events, MemorySink, container_record, needs_vm, sandbox_record

pytestmark = needs_vm


async def test_supplemental_groups_policy_merge_and_strict(
    runv: tuple[RunvBackend, Events], busybox_rootfs: Path, tmp_path: Path
) -> None:
    """Merge (the default) adds the image's groups of the user; Strict does not; the status says which."""
    import shutil

    from shim.cri.messages import container_status_pb

    backend, events = runv
    assert backend.capabilities & Capability.SUPPLEMENTAL_GROUPS_POLICY
    root = tmp_path / "groups-image"
    shutil.copytree(busybox_rootfs, root, symlinks=True)
    (root / "etc/passwd").write_text("root:x:0:0::/root:/bin/sh\nuser:x:1000:1000::/:/bin/sh\n")
    (root / "etc/group").write_text("root:x:0:\nuser:x:1000:\nimage-group:x:50000:user\n")
    backend.image_store.import_dir("test/groups:1", str(root), {})
    sb = sandbox_record("groups")
    await backend.lifecycle.run_sandbox(sb)
    seen = {}
    for policy in (pb.Merge, pb.Strict):
        ct = container_record(sb, "test/groups:1", ["sleep", "60"], name=f"c{policy}")
        sc = ct.config.linux.security_context
        sc.run_as_user.value = 1000
        sc.supplemental_groups.append(1234)
        sc.supplemental_groups_policy = policy
        await backend.lifecycle.create_container(ct, sb)
        await events.start(backend.lifecycle, ct, sb, MemorySink())
        res = await backend.exec.exec_sync(ct, ["id", "-G"])
        user = container_status_pb(ct).user.linux
        seen[policy] = (res.stdout.decode().split(), user.uid, user.gid, sorted(user.supplemental_groups))
        await backend.lifecycle.stop_container(ct, 1)
        await backend.lifecycle.remove_container(ct)
    assert seen[pb.Merge] == (["1000", "1234", "50000"], 1000, 1000, [1000, 1234, 50000])
    assert seen[pb.Strict] == (["1000", "1234"], 1000, 1000, [1000, 1234])
    await backend.lifecycle.stop_sandbox(sb)
    await backend.lifecycle.remove_sandbox(sb)
