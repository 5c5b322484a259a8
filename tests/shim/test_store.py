"""Records, prefix lookup, the registrar and atomic persistence."""

import json
import os

import pytest

from backends.contract import ContainerRecord, ContainerStatus, EffectiveUser, SandboxRecord, SandboxStatus
from cri_api import api_pb2 as pb
from shim.cri.errors import AlreadyExistsError, InvalidArgumentError, NotFoundError, ResourceExhaustedError
from shim.cri.messages import container_status_pb
from shim.cri.store import StateDir, Store, container_from_json, container_to_json
from tests.criutil import container_config, sandbox_config


def sandbox(i: str) -> SandboxRecord:
    return SandboxRecord(
        id=i,
        handler="",
        backend="fake",
        config=sandbox_config(),
        created_at=1,
        status=SandboxStatus(ready=True, ip="10.0.0.2"),
        committed=True,
    )


def test_prefix_lookup() -> None:
    s = Store(None)
    s.add(sandbox("ab" + "0" * 62))
    s.add(sandbox("ac" + "0" * 62))
    assert s.sandboxes.find("ab").id.startswith("ab")
    with pytest.raises(InvalidArgumentError, match="ambiguous"):
        s.sandboxes.find("a")
    with pytest.raises(NotFoundError):
        s.sandboxes.find("ff")
    assert s.sandboxes.find("ff", missing="none") is None


def test_registrar() -> None:
    s = Store(None)
    s.sandbox_names.reserve("n", "id1")
    s.sandbox_names.reserve("n", "id1")  # the owner may reserve again
    with pytest.raises(AlreadyExistsError):
        s.sandbox_names.reserve("n", "id2")
    s.sandbox_names.release("n", "id2")  # not the owner: no effect
    assert s.sandbox_names.owner("n") == "id1"
    s.sandbox_names.release("n", "id1")
    s.sandbox_names.reserve("n", "id2")


def test_persistence_round_trip(tmp_path: object) -> None:
    root = str(tmp_path)
    s = Store(StateDir(root))
    sb = sandbox("a" * 64)
    s.add(sb)
    c = ContainerRecord(
        id="b" * 64,
        sandbox_id=sb.id,
        backend="fake",
        config=container_config(labels={"x": "y"}),
        created_at=5,
        log_path="/l",
        status=ContainerStatus(started_at=6, finished_at=7, exit_code=3, reason="Error"),
        stop_signal=pb.SIGNAL_SIGQUIT,
        image_volume_refs={"/data": "sha256:" + "1" * 64},
        effective_user=EffectiveUser(1000, 1001, (5, 6)),
        backend_data={"engine_id": "e"},
        committed=True,
    )
    s.add(c)
    # An interrupted write leaves a .tmp beside the real file; it is ignored.
    with open(os.path.join(root, "containers", "c" * 64 + ".json.tmp"), "w") as f:
        f.write("{truncated")
    with open(os.path.join(root, "containers", "d" * 64 + ".json"), "w") as f:
        f.write("not json")
    s2 = Store(StateDir(root))
    s2.load()
    got = s2.containers.get(c.id)
    assert got is not None
    assert got.status == c.status and got.config == c.config and got.backend_data == {"engine_id": "e"}
    assert (got.stop_signal, got.image_volume_refs, got.effective_user) == (
        pb.SIGNAL_SIGQUIT,
        {"/data": "sha256:" + "1" * 64},
        EffectiveUser(1000, 1001, (5, 6)),
    )
    assert got.status.state == pb.CONTAINER_EXITED
    assert s2.sandboxes.get(sb.id).status == sb.status  # type: ignore[union-attr]
    assert len(s2.containers) == 1
    assert os.path.exists(os.path.join(root, "quarantine", "containers-" + "d" * 64 + ".json"))
    with pytest.raises(AlreadyExistsError):
        s2.sandbox_names.reserve("pod_default_" + sb.config.metadata.uid + "_0", "other")


@pytest.mark.parametrize("swap", [True, False])
def test_rewrites_swap_the_record_and_leave_no_temporary(
    tmp_path: object, monkeypatch: pytest.MonkeyPatch, swap: bool
) -> None:
    import shim.cri.store as store_module

    if not swap:  # a kernel or filesystem without RENAME_EXCHANGE: plain renames
        monkeypatch.setattr(store_module, "_renameat2", None)
    root = str(tmp_path)
    path = os.path.join(root, "r.json")
    StateDir.write_atomic(path, b"one")  # no record yet: a rename
    first = os.stat(path).st_ino
    StateDir.write_atomic(path, b"two")
    with open(path, "rb") as f:
        assert f.read() == b"two"
    assert os.listdir(root) == ["r.json"]
    assert os.stat(path).st_ino != first  # a new file took the name, never a rewrite in place


def test_a_swap_cut_short_leaves_the_new_record_and_loading_drops_the_old(tmp_path: object) -> None:
    d = StateDir(str(tmp_path))
    s = Store(d)
    sb = sandbox("e" * 64)
    s.add(sb)
    path = os.path.join(d.sandboxes, sb.id + ".json")
    # A crash between the swap and the unlink: the old record sits at .tmp.
    with open(path + ".tmp", "w") as f:
        f.write("{}")
    sandboxes, _ = StateDir(str(tmp_path)).load()
    assert [r.id for r in sandboxes] == [sb.id] and not os.path.exists(path + ".tmp")


def test_a_quiet_lookup_matches_nothing_when_ambiguous() -> None:
    s = Store(None)
    s.add(sandbox("ab" + "0" * 62))
    s.add(sandbox("ac" + "0" * 62))
    assert s.sandboxes.find("a", missing="quiet") is None
    assert s.sandboxes.find("ff", missing="quiet") is None
    with pytest.raises(InvalidArgumentError, match="ambiguous"):
        s.sandboxes.find("a", missing="none")  # Stop/Remove of an ambiguous prefix is still an error
    with pytest.raises(InvalidArgumentError, match="empty"):
        s.sandboxes.find("")


def _full_disk(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every record write from now on refused as a full disk; the paths it was asked for."""
    asked: list[str] = []

    def refuse(path: str, data: bytes) -> None:
        asked.append(path)
        raise ResourceExhaustedError(f"cannot record {path}: No space left on device")

    monkeypatch.setattr(StateDir, "write_atomic", staticmethod(refuse))
    return asked


def _on_disk(root: str, sb: SandboxRecord) -> dict[str, object]:
    with open(os.path.join(root, "sandboxes", sb.id + ".json")) as f:
        data: dict[str, object] = json.load(f)
    return data


def test_an_update_the_disk_refuses_changes_nothing(
    tmp_path: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = str(tmp_path)
    s = Store(StateDir(root))
    sb = sandbox("a" * 64)
    s.add(sb)
    revision, version = sb.revision, s.sandboxes.version
    _full_disk(monkeypatch)
    with pytest.raises(ResourceExhaustedError):
        s.update(sb, status=SandboxStatus(ready=False))
    assert sb.status.ready and (sb.revision, s.sandboxes.version) == (revision, version)
    assert _on_disk(root, sb)["ready"] is True
    monkeypatch.undo()
    s.update(sb, status=SandboxStatus(ready=False))  # disk first, then memory, then counted
    assert not sb.status.ready and _on_disk(root, sb)["ready"] is False
    assert (sb.revision, s.sandboxes.version) == (revision + 1, version + 1)


def test_an_effect_changes_memory_and_reaches_the_disk_once_it_takes_it(
    tmp_path: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = str(tmp_path)
    s = Store(StateDir(root))
    sb = sandbox("a" * 64)
    s.add(sb)
    asked = _full_disk(monkeypatch)
    s.record_effect(sb, status=SandboxStatus(ready=False))
    assert not sb.status.ready and asked and s.unsaved_ids() == [sb.id]
    assert _on_disk(root, sb)["ready"] is True
    monkeypatch.undo()
    assert s.retry_unsaved() and s.unsaved_ids() == []
    assert _on_disk(root, sb)["ready"] is False


def test_a_removed_record_is_gone_from_tables_names_index_and_disk(tmp_path: object) -> None:
    root = str(tmp_path)
    s = Store(StateDir(root))
    sb = sandbox("a" * 64)
    s.sandbox_names.reserve("n", sb.id)
    s.add(sb)
    c = ContainerRecord(
        id="c" * 64, sandbox_id=sb.id, backend="fake", config=container_config("x"), created_at=2, log_path=""
    )
    s.add(c)
    assert s.containers_of(sb.id) == [c]
    version = s.containers.version
    s.remove(c)
    assert s.containers_of(sb.id) == [] and s.containers.version > version
    assert not os.path.exists(os.path.join(root, "containers", c.id + ".json"))
    s.remove(sb)
    assert s.sandboxes.get(sb.id) is None and sb.id not in s.by_sandbox
    assert not os.path.exists(os.path.join(root, "sandboxes", sb.id + ".json"))


def test_a_record_of_the_layout_before_the_typed_fields_loads_with_them_filled(tmp_path: object) -> None:
    """What ContainerStatus reports of a backend's work (the stop signal, the image of each image
    volume, the effective user) was in backend_data before it had fields of its own: a record
    written then is loaded with them moved into the fields, and the rest of backend_data kept."""
    mount = pb.Mount(container_path="/data", image=pb.ImageSpec(image="registry.example/data:1"))
    config = container_config()
    config.mounts.append(mount)
    now = ContainerRecord(
        id="b" * 64,
        sandbox_id="a" * 64,
        backend="runv",
        config=config,
        created_at=5,
        log_path="",
        committed=True,
    )
    old = container_to_json(now)
    for key in ("stop_signal", "image_volume_refs", "effective_user"):
        del old[key]
    old["backend_data"] = {
        "vm": "vm-1",
        "stop_signal": "SIGUSR1",
        "image_volumes": {"/data": "sha256:" + "2" * 64},
        "user": {"uid": 1000, "gid": 1000, "groups": [1000, 1234]},
    }
    root = str(tmp_path)
    os.makedirs(os.path.join(root, "containers"))
    with open(os.path.join(root, "containers", now.id + ".json"), "w") as f:
        json.dump(old, f)
    s = Store(StateDir(root))
    s.load()
    got = s.containers.get(now.id)
    assert got is not None
    assert got.stop_signal == pb.SIGNAL_SIGUSR1
    assert got.image_volume_refs == {"/data": "sha256:" + "2" * 64}
    assert got.effective_user == EffectiveUser(1000, 1000, (1000, 1234))
    assert got.backend_data == {"vm": "vm-1"}  # the backend's own bookkeeping stays, opaque
    status = container_status_pb(got)
    assert status.stop_signal == pb.SIGNAL_SIGUSR1
    assert status.mounts[0].image.image_ref == "sha256:" + "2" * 64
    assert (status.user.linux.uid, status.user.linux.gid, list(status.user.linux.supplemental_groups)) == (
        1000,
        1000,
        [1000, 1234],
    )
    # Written again, it is in the new layout, and reads back the same.
    again = container_from_json(json.loads(json.dumps(container_to_json(got))))
    assert (again.stop_signal, again.image_volume_refs, again.effective_user, again.backend_data) == (
        got.stop_signal,
        got.image_volume_refs,
        got.effective_user,
        {"vm": "vm-1"},
    )


@pytest.mark.parametrize(
    ("written", "want"),
    [
        ("SIGNAL_SIGQUIT", pb.SIGNAL_SIGQUIT),  # as written since cri-api 2026-07
        ("SIGQUIT", pb.SIGNAL_SIGQUIT),  # as written before the enum's values were renamed
        ("SIGRTMINPLUS3", pb.SIGNAL_SIGRTMINPLUS3),
        ("RUNTIME_DEFAULT", pb.SIGNAL_RUNTIME_DEFAULT),
        ("", pb.SIGNAL_RUNTIME_DEFAULT),
        ("SIGBOGUS", pb.SIGNAL_RUNTIME_DEFAULT),
    ],
)
def test_a_stop_signal_recorded_by_its_old_or_new_name_loads(
    tmp_path: object, written: str, want: int
) -> None:
    """The stop signal is recorded by its enum name; the names gained a SIGNAL_ prefix (same
    numbers), so a record written by an older shim loads with the same signal, and is written
    back under the new name."""
    c = ContainerRecord(
        id="b" * 64,
        sandbox_id="a" * 64,
        backend="fake",
        config=container_config(),
        created_at=5,
        log_path="",
        stop_signal=pb.SIGNAL_SIGQUIT,
        committed=True,
    )
    record = container_to_json(c)
    assert record["stop_signal"] == "SIGNAL_SIGQUIT"
    record["stop_signal"] = written
    got = container_from_json(json.loads(json.dumps(record)))
    assert got.stop_signal == want
    assert container_to_json(got)["stop_signal"] == (pb.Signal.Name(want) if want else "")
