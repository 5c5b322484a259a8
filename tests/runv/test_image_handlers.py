"""Images per runtime handler on a node with the fake (default) and runv (KEP-4216): a pull, status,
list or remove naming runv uses runv's own store (from the testenv registry), the fake's stays
apart; runv reports the sandbox image and the ``pinned`` patterns pinned; the [images] options
reach its PullSettings."""

from __future__ import annotations

import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from backends.contract.errors import InvalidArgumentError
from backends.oci.settings import PullSettings
from backends.runv.backend import RunvBackend, pull_settings
from cri_api import api_pb2 as pb
from tests.shim.services_kit import Kit, open_kit

REGISTRY = "127.0.0.1:5000"
BUSYBOX = f"{REGISTRY}/busybox:1.36"
PAUSE = f"{REGISTRY}/pause:3.10"


def _registry_up() -> bool:
    try:
        with urllib.request.urlopen(f"http://{REGISTRY}/v2/", timeout=1):
            return True
    except OSError:
        return False


needs_registry = pytest.mark.skipif(
    not _registry_up(), reason=f"no registry on {REGISTRY} (scripts/testenv/up starts one)"
)


@pytest.fixture
async def node(tmp_path: Path, runv_config: dict[str, Any]) -> AsyncIterator[Kit]:
    runv = RunvBackend("runv", {**runv_config, "pause_image": PAUSE, "pinned": [f"{REGISTRY}/busybox:*"]})
    async with open_kit(str(tmp_path / "node"), images=(), handlers={"runv": runv}, pause_image=PAUSE) as kit:
        yield kit


def spec(image: str, handler: str = "") -> pb.ImageSpec:
    return pb.ImageSpec(image=image, runtime_handler=handler)


async def status(kit: Kit, image: str, handler: str = "") -> pb.Image | None:
    resp = await kit.ok("ImageStatus", pb.ImageStatusRequest(image=spec(image, handler)))
    return resp.image if resp.HasField("image") else None


async def listed(kit: Kit, handler: str = "") -> dict[str, pb.Image]:
    req = pb.ListImagesRequest()
    if handler:
        req.filter.image.runtime_handler = handler
    return {i.id: i for i in (await kit.ok("ListImages", req)).images}


@needs_registry
async def test_pull_status_list_remove_naming_runv_use_its_store(node: Kit) -> None:
    ref = (await node.ok("PullImage", pb.PullImageRequest(image=spec(BUSYBOX, "runv")))).image_ref
    got = await status(node, BUSYBOX, "runv")
    assert got is not None and got.id == ref and got.spec.runtime_handler == "runv"
    assert got.pinned  # by the pinned pattern
    assert await status(node, BUSYBOX) is None  # the default handler (the fake) has not pulled it
    of_runv = await listed(node, "runv")
    assert of_runv[ref].spec.runtime_handler == "runv" and of_runv[ref].pinned
    assert ref not in await listed(node, "fake")
    assert (await listed(node))[ref].spec.runtime_handler == ""  # the node's list: no handler
    # The sandbox image, pulled into runv's store, is pinned there too.
    pause = (await node.ok("PullImage", pb.PullImageRequest(image=spec(PAUSE, "runv")))).image_ref
    assert (await listed(node, "runv"))[pause].pinned
    await node.ok("RemoveImage", pb.RemoveImageRequest(image=spec(BUSYBOX, "runv")))
    assert await status(node, BUSYBOX, "runv") is None and ref not in await listed(node)
    assert await status(node, pause, "runv") is not None


def test_the_images_options_are_runvs_pull_settings() -> None:
    default = PullSettings()
    assert pull_settings({}) == default
    got = pull_settings(
        {
            "registry_config_path": "/etc/cri-shim/certs.d",
            "credentials_file": "/etc/cri-shim/auth.json",
            "max_concurrent_downloads": 6,
            "image_pull_progress_timeout": 0,
            "pinned": ["a:*"],
            "insecure_registries": ["r:1"],
        }
    )
    assert got == PullSettings(
        insecure=frozenset({"r:1"}),
        config_path="/etc/cri-shim/certs.d",
        credentials_file="/etc/cri-shim/auth.json",
        max_concurrent_downloads=6,
        progress_timeout=0.0,
        pinned=("a:*",),
    )
    assert pull_settings({"pull_no_progress_timeout": 12}).progress_timeout == 12.0  # the old name
    with pytest.raises(InvalidArgumentError, match="max_concurrent_downloads"):
        pull_settings({"max_concurrent_downloads": 0})


def test_a_bad_pinned_pattern_is_an_error_at_creation(runv_config: dict[str, Any]) -> None:
    with pytest.raises(InvalidArgumentError, match="pinned: 'Not A Ref'"):
        RunvBackend("runv", {**runv_config, "pinned": ["Not A Ref"]})
