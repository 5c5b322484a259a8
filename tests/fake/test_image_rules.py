"""The fake's image rules as a node e2e double needs them (backends/fake/images.py): the images a
registry has (``available_images``), ENTRYPOINT and CMD (built in for agnhost), and what a container
then runs (backends/fake/environment.py, lifecycle.py)."""

from __future__ import annotations

import pytest

from backends.contract import ContainerRecord, ProcessPipe
from backends.contract.errors import InvalidArgumentError, NotFoundError
from backends.fake import create
from backends.fake.environment import command_of
from backends.fake.images import FakeImages
from backends.fake.lifecycle import FakeLifecycle
from cri_api import api_pb2 as pb
from tests.fake.test_parts import container, parts, sandbox

AGNHOST = "registry.k8s.io/e2e-test-images/agnhost:2.56"
PAUSE = "registry.k8s.io/pause:3.10.1"


def store(**options: object) -> FakeImages:
    s = FakeImages({"pull_seconds": 0, "pause_image": PAUSE, **options})
    s.load()
    return s


@pytest.mark.parametrize(
    ("image", "found"),
    [
        (AGNHOST, True),
        ("registry.k8s.io/e2e-test-images/busybox:1.37.0-1", True),
        ("registry.k8s.io/e2e-test-images/nginx:1.15-4", True),  # a pattern
        (PAUSE, True),  # the sandbox image, listed or not
        ("registry.k8s.io/e2e-test-images/agnhost:2.99", False),  # another tag
        ("registry.k8s.io/invalid-image:invalid-tag", False),
        ("busybox@sha256:" + "a" * 64, False),
        ("docker.io/library/busybox:1.36", False),
    ],
    ids=[
        "listed",
        "listed-2",
        "pattern",
        "sandbox-image",
        "other-tag",
        "nonexistent",
        "digest",
        "other-registry",
    ],
)
async def test_available_images_are_the_only_ones_a_pull_finds(image: str, found: bool) -> None:
    s = store(
        available_images=[AGNHOST, "registry.k8s.io/e2e-test-images/busybox:1.37.0-1", "*/nginx:1.1[45]-4"]
    )
    spec = pb.ImageSpec(image=image)
    if found:
        assert (await s.pull_image(spec, None, None)).startswith("sha256:")
        return
    with pytest.raises(NotFoundError, match="has only the images of its available_images list"):
        await s.pull_image(spec, None, None)
    assert await s.image_status(spec) is None


async def test_without_available_images_every_pull_finds_its_image() -> None:
    s = store()
    assert await s.pull_image(pb.ImageSpec(image="registry.k8s.io/invalid-image:invalid-tag"), None, None)


def test_available_images_is_a_checked_option() -> None:
    with pytest.raises(InvalidArgumentError, match="available_images: expected a list of strings"):
        create("fake", {"available_images": "registry.k8s.io/*"})
    assert create("fake", {"available_images": ["registry.k8s.io/*"]}) is not None


async def test_agnhost_has_its_entrypoint_and_cmd_on_any_registry_and_by_id() -> None:
    s = store(images={"example.com/app": {"entrypoint": ["/app", "-v"], "cmd": ["serve"]}})
    iid = await s.pull_image(pb.ImageSpec(image=AGNHOST), None, None)
    assert s.process_for(AGNHOST) == (["/agnhost"], ["pause"])
    assert s.process_for(iid) == (["/agnhost"], ["pause"])  # the kubelet names the image by its ID
    assert s.process_for("k8s.gcr.io/e2e-test-images/agnhost:2.40") == (["/agnhost"], ["pause"])
    assert s.process_for("example.com/app:1") == (["/app", "-v"], ["serve"])
    assert s.process_for("busybox:1.36") == ([], [])


def test_entrypoint_and_cmd_rules_are_checked() -> None:
    with pytest.raises(ValueError, match=r"images\.app\.cmd must be a list of strings"):
        FakeImages({"images": {"app": {"cmd": "serve"}}})


def _with(command: list[str], args: list[str]) -> ContainerRecord:
    c = container("c" * 64, command=command)
    c.config.args.extend(args)
    return c


@pytest.mark.parametrize(
    ("command", "args", "argv"),
    [
        ([], [], ["/agnhost", "pause"]),
        ([], ["mounttest", "--file_mode=/x"], ["/agnhost", "mounttest", "--file_mode=/x"]),
        (["/agnhost-2"], [], ["/agnhost-2"]),
        (["/agnhost-2"], ["entrypoint-tester"], ["/agnhost-2", "entrypoint-tester"]),
    ],
    ids=["image-defaults", "args-after-entrypoint", "command-drops-cmd", "command-and-args"],
)
def test_a_containers_argv_as_kubernetes_combines_it_with_its_image(
    command: list[str], args: list[str], argv: list[str]
) -> None:
    assert command_of(_with(command, args), ["/agnhost"], ["pause"]) == argv


async def _logs(life: FakeLifecycle, c: ContainerRecord) -> tuple[int, bytes]:
    sb = sandbox("5" * 64)
    await life.run_sandbox(sb)
    await life.create_container(c, sb)
    started = await life.start_container(c, sb)
    assert isinstance(started.process, ProcessPipe)
    out = b"".join([o.data async for o in started.process.output()])
    info = started.process.exit.info
    assert info is not None
    return info.exit_code, out


async def test_an_agnhost_container_with_args_only_runs_its_subcommand() -> None:
    images, _, life = parts({"pull_seconds": 0})
    iid = await images.pull_image(pb.ImageSpec(image=AGNHOST), None, None)
    c = container("c" * 64, image=iid)
    c.config.args.extend(["entrypoint-tester", "override", "arguments"])
    code, out = await _logs(life, c)
    assert (code, out) == (0, b"[/agnhost entrypoint-tester override arguments]\n")
    await life.close()
