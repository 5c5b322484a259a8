"""The docker backend's image volume stacks (image_volumes.py): layers, mounts, release and sweep."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from backends.contract.errors import InvalidArgumentError, NotFoundError
from backends.docker.image_volumes import ImageVolumes, layers_of
from cri_api import api_pb2 as pb

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to mount")


def inspection(top: Path, *below: Path) -> dict[str, object]:
    data = {"UpperDir": str(top)}
    if below:
        data["LowerDir"] = ":".join(str(b) for b in below)
    return {"GraphDriver": {"Name": "overlay2", "Data": data}}


def test_layers_top_first_and_only_overlay2() -> None:
    assert layers_of(
        {"GraphDriver": {"Name": "overlay2", "Data": {"UpperDir": "/u", "LowerDir": "/a:/b"}}}
    ) == [
        "/u",
        "/a",
        "/b",
    ]
    assert layers_of({"GraphDriver": {"Name": "vfs", "Data": {"UpperDir": "/u"}}}) == []
    assert layers_of({}) == []


@needs_root
def test_stacks_are_read_only_and_go_with_release_or_sweep(tmp_path: Path) -> None:
    top, bottom = tmp_path / "top", tmp_path / "bottom"
    for d in (top / "etc", bottom / "etc"):
        d.mkdir(parents=True)
    (top / "etc/a").write_text("top")
    (bottom / "etc/a").write_text("bottom")
    (bottom / "etc/b").write_text("bottom")
    vols = ImageVolumes(str(tmp_path / "vols"))
    mnt = pb.Mount(container_path="/v", readonly=True, image=pb.ImageSpec(image="img"), image_sub_path="etc")
    src = Path(vols.stack("c1", 0, mnt, inspection(top, bottom)))
    assert (src / "a").read_text() == "top" and (src / "b").read_text() == "bottom"
    with pytest.raises(OSError):
        (src / "c").write_text("no")
    single = Path(
        vols.stack("c2", 0, pb.Mount(container_path="/w", image=pb.ImageSpec(image="i")), inspection(top))
    )
    with pytest.raises(OSError):
        (single / "etc" / "x").write_text("no")
    with pytest.raises(InvalidArgumentError):
        vols.stack("c3", 0, pb.Mount(container_path="/x", image_sub_path="missing"), inspection(top))
    with pytest.raises(NotFoundError):
        vols.stack("c4", 0, pb.Mount(container_path="/x"), inspection(tmp_path / "absent"))
    vols.release("c1")
    assert not (tmp_path / "vols" / "c1").exists()
    assert (top / "etc/a").read_text() == "top"  # the layers themselves are untouched
    vols.sweep(known=["c2"])  # c3's (failed) stack goes; c2 stays
    assert sorted(os.listdir(tmp_path / "vols")) == ["c2"]
    vols.sweep(known=[])
    assert os.listdir(tmp_path / "vols") == []
    with open("/proc/self/mountinfo") as fh:
        assert str(tmp_path / "vols") not in fh.read()
