"""runv's checkpoint archive (backends/runv/checkpoint_archive.py) and the refusals of its
Checkpoint part that need no VM: written, verified and extracted whole; truncated, foreign,
tampered or mutated archives refused with InvalidArgument or FailedPrecondition and nothing else;
a guest image without CRIU named in the refusal."""

from __future__ import annotations

import asyncio
import io
import json
import os
import random
import stat
import tarfile
from pathlib import Path
from typing import Any

import pytest

from backends.contract import errors
from backends.runv import checkpoint_archive as archive
from backends.runv.backend import RunvBackend
from backends.runv.checkpoint import VmCheckpoints
from tests.criutil import container_config, sandbox_config
from tests.runv.helpers import container_record, sandbox_record


def _captured(tmp: Path, name: str = "app") -> archive.Captured:
    own = tmp / ("c-" + name)
    (own / "checkpoint").mkdir(parents=True)
    (own / "checkpoint" / "inventory.img").write_bytes(b"\x01" * 100)
    (own / "checkpoint" / "pages-1.img").write_bytes(os.urandom(5000))
    with tarfile.open(own / "rootfs-diff.tar", "w"):
        pass
    (own / "deleted.files").write_text("[]")
    entry = archive.Entry(name, "id-" + name, container_config(name=name), "busybox", "sha256:" + "a" * 64)
    return archive.Captured(entry, str(own))


def _written(tmp: Path, kind: str = "pod", names: tuple[str, ...] = ("app",)) -> str:
    path = str(tmp / "pod.tar")
    pod = sandbox_config(name="p") if kind == "pod" else None
    archive.write(path, kind, pod, [_captured(tmp, n) for n in names])
    return path


def test_written_verified_and_extracted(tmp_path: Path) -> None:
    path = _written(tmp_path, names=("a", "b"))
    m = archive.verify(path, "pod")
    assert [e.name for e in m.containers] == ["a", "b"] and m.pod is not None
    assert m.pod.metadata.name == "p" and m.containers[0].config.metadata.name == "a"
    dest = tmp_path / "out"
    dest.mkdir()
    archive.extract(path, m, m.entry("b"), str(dest))
    assert (dest / "checkpoint" / "pages-1.img").read_bytes() == (
        tmp_path / "c-b" / "checkpoint" / "pages-1.img"
    ).read_bytes()
    assert sorted(os.listdir(dest)) == ["checkpoint", "deleted.files", "rootfs-diff.tar"]
    with pytest.raises(errors.InvalidArgumentError, match="pod checkpoint, not a container one"):
        archive.verify(path, "container")
    with pytest.raises(errors.FailedPreconditionError, match="no container named 'c'"):
        m.entry("c")


@pytest.mark.skipif(os.geteuid() != 0, reason="a whiteout is a character device: mknod needs root")
def test_a_writable_layer_becomes_a_diff_and_its_removals(tmp_path: Path) -> None:
    upper = tmp_path / "upper"
    (upper / "etc" / "new").mkdir(parents=True)
    (upper / "etc" / "new" / "file").write_text("written")
    (upper / "state").write_text("kept")
    os.symlink("state", upper / "link")
    os.mknod(upper / "etc" / "gone", stat.S_IFCHR | 0o600, os.makedev(0, 0))  # a whiteout
    opaque = upper / "var"
    opaque.mkdir()
    (opaque / "again").write_text("x")
    os.setxattr(opaque, archive.OPAQUE_XATTR, b"y")
    removed = archive.rootfs_diff(str(upper), str(tmp_path / "diff.tar"))
    assert sorted(removed) == ["etc/gone", "var"]
    with tarfile.open(tmp_path / "diff.tar") as tar:
        names = sorted(tar.getnames())
    assert names == ["etc", "etc/new", "etc/new/file", "link", "state", "var", "var/again"]


def test_truncated_foreign_and_tampered_archives_are_refused(tmp_path: Path) -> None:
    path = _written(tmp_path)
    data = Path(path).read_bytes()
    bad = tmp_path / "bad.tar"
    bad.write_bytes(data[: len(data) // 2])
    with pytest.raises(errors.InvalidArgumentError, match="truncated"):
        archive.verify(str(bad), "pod")
    bad.write_bytes(b"not a tar at all" * 100)
    with pytest.raises(errors.InvalidArgumentError):
        archive.verify(str(bad), "pod")
    with tarfile.open(bad, "w") as tar:
        tar.add(path, arcname="something.else")
    with pytest.raises(errors.InvalidArgumentError, match=r"does not begin with a manifest\.json"):
        archive.verify(str(bad), "pod")
    # One byte of CRIU's pages changed: its checksum does not match.
    at = data.index(Path(tmp_path / "c-app" / "checkpoint" / "pages-1.img").read_bytes()[:64])
    bad.write_bytes(data[:at] + bytes([data[at] ^ 1]) + data[at + 1 :])
    with pytest.raises(errors.FailedPreconditionError, match="does not match its checksum"):
        archive.verify(str(bad), "pod")
    # The manifest edited: its own checksum no longer matches.
    at = data.index(b'"kind": "pod"')
    bad.write_bytes(data[:at] + b'"kind": "poe"' + data[at + 13 :])
    with pytest.raises(errors.FailedPreconditionError, match="manifest does not match"):
        archive.verify(str(bad), "pod")
    with pytest.raises(errors.InvalidArgumentError, match="does not exist"):
        archive.verify(str(tmp_path / "none.tar"), "pod")


def test_a_member_added_or_missing_is_refused(tmp_path: Path) -> None:
    path = _written(tmp_path)
    with tarfile.open(path) as tar:
        members = [(i, tar.extractfile(i).read() if i.isreg() else b"") for i in tar]  # type: ignore[union-attr]
    for variant, edit in (("added", "add"), ("missing", "drop")):
        out = tmp_path / f"{variant}.tar"
        with tarfile.open(out, "w") as tar:
            for info, blob in members:
                if edit == "drop" and info.name.endswith("pages-1.img"):
                    continue
                tar.addfile(info, io.BytesIO(blob))
            if edit == "add":
                extra = tarfile.TarInfo("containers/app/checkpoint/extra.img")
                extra.size = 1
                tar.addfile(extra, io.BytesIO(b"x"))
        want = errors.FailedPreconditionError if edit == "add" else errors.InvalidArgumentError
        with pytest.raises(want, match=r"not in its manifest|lacks 1 member"):
            archive.verify(str(out), "pod")


def test_mutated_archives_only_ever_fail_as_bad_input(tmp_path: Path) -> None:
    """The fuzz corpus of runv's archives: bit flips, cuts and garbage of a real one."""
    data = Path(_written(tmp_path, names=("a", "b"))).read_bytes()
    rnd = random.Random(43)
    bad = tmp_path / "mutant.tar"
    outcomes: dict[str, int] = {}
    for i in range(300):
        blob = bytearray(data)
        how = i % 3
        if how == 0:
            for _ in range(rnd.randint(1, 8)):
                blob[rnd.randrange(len(blob))] ^= 1 << rnd.randrange(8)
        elif how == 1:
            blob = blob[: rnd.randrange(len(blob))]
        else:
            at = rnd.randrange(len(blob))
            blob[at : at + 64] = os.urandom(64)
        bad.write_bytes(bytes(blob))
        try:
            archive.verify(str(bad), "pod")
            outcome = "ok"  # a flip the format does not read (tar padding)
        except (errors.InvalidArgumentError, errors.FailedPreconditionError) as exc:
            outcome = type(exc).__name__
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
    assert outcomes.get("FailedPreconditionError") and outcomes.get("InvalidArgumentError"), outcomes


@pytest.fixture
def no_criu(tmp_path: Path, runv_config: dict[str, Any]) -> RunvBackend:
    guest = tmp_path / "guest"
    guest.mkdir()
    (guest / "manifest.json").write_text(json.dumps({"criu": False}))
    cfg = {**runv_config, "driver": "qemu", "qemu": {"guest_dir": str(guest)}}
    return RunvBackend("vm", cfg)


def test_a_guest_without_criu_is_named_in_every_refusal(no_criu: RunvBackend, tmp_path: Path) -> None:
    part = no_criu.checkpoint
    assert isinstance(part, VmCheckpoints)
    path = _written(tmp_path)
    sb = sandbox_record("p")
    c = container_record(sb, "busybox", ["sleep", "1"])

    async def refusals() -> list[errors.CriError]:
        out: list[errors.CriError] = []
        for call in (
            lambda: part.open_pod_checkpoint(str(tmp_path), {}, [container_config(name="app")]),
            lambda: part.open_container_checkpoint(path),
            lambda: part.checkpoint_pod(sb, [c], str(tmp_path), {}),
            lambda: part.checkpoint_container(c, str(tmp_path / "c.tar"), 0),
        ):
            try:
                await call()
            except errors.CriError as exc:
                out.append(exc)
        return out

    got = asyncio.run(refusals())
    assert len(got) == 4
    for exc in got[:2]:
        assert isinstance(exc, errors.FailedPreconditionError)
        assert "needs CRIU" in str(exc) and "scripts/runv-guest --criu" in str(exc)
    for exc in got[2:]:  # no such pod in this backend: found out before CRIU is asked
        assert isinstance(exc, errors.NotFoundError | errors.FailedPreconditionError), exc


def test_options_are_refused_by_name(no_criu: RunvBackend, tmp_path: Path) -> None:
    part = no_criu.checkpoint
    assert isinstance(part, VmCheckpoints)
    with pytest.raises(errors.InvalidArgumentError, match="option 'compress'"):
        asyncio.run(part.open_pod_checkpoint(str(tmp_path), {"compress": "zstd"}, []))


def test_the_stub_driver_still_asks_the_hosts_criu(runv_config: dict[str, Any]) -> None:
    assert not isinstance(RunvBackend("runv", runv_config).checkpoint, VmCheckpoints)
