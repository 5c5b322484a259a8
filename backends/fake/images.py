"""The fake's image store: images in memory, persisted in the state directory.

A pull takes ``pull_seconds`` (0.01), as a real one takes time, so that client
deadlines mean something. All tags of one repository path are one image, on
every registry (a mirror such as k8s.gcr.io/pause serves
registry.k8s.io/pause), except the pinned sandbox image; the ``images`` rules
(by ``REPO`` or ``REPO:TAG``) may give ``id``, ``size``, ``uid``,
``username``, ``stop_signal`` (its STOPSIGNAL: what its containers are stopped
with unless their config names one), ``files`` (path = text: what its
containers' file systems start with), ``entrypoint`` and ``cmd`` (its ENTRYPOINT
and CMD: what a container runs when its config gives no command, or no command
and no args, as Kubernetes combines them), ``annotations`` (its manifest's: an
image made from a container checkpoint has ``io.kubernetes.cri-o.annotations.checkpoint.name``,
and the archive's members as its ``files``). Built-in rules, under the configured
ones, give the Kubernetes e2e images theirs (agnhost: ``/agnhost`` ``pause``),
on any registry. ``missing_images`` patterns make pulls fail with NOT_FOUND;
a non-empty ``available_images`` list makes every pull it does not match (by
full name, ``registry.k8s.io/pause:3.10.1``, or as written) fail with NOT_FOUND
too, as a registry that has only those images (the pinned sandbox image is
always there).
Every pull is recorded in ``pulls`` with the auth it carried. The sandbox image, and
the images the ``pinned`` patterns match (backends.contract.pinning), are reported pinned.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import fnmatch
import hashlib
import json
import os
import time
from collections.abc import Callable, Collection, Mapping
from typing import Any

from backends.contract import ImageInfo, errors
from backends.contract.pinning import PinnedImages
from backends.oci.hosts import Hosts, load_hosts
from backends.reference import BadReference, Reference, parse
from cri_api import api_pb2 as pb

# The ENTRYPOINT and CMD of images the Kubernetes e2e suites run, by repository path (any registry,
# any tag): their containers name only a subcommand (agnhost's ``mounttest``...), or nothing.
BUILTIN_RULES: dict[str, dict[str, Any]] = {
    "e2e-test-images/agnhost": {"entrypoint": ["/agnhost"], "cmd": ["pause"]},
    "e2e-test-images/nonewprivs": {"cmd": ["nnp"]},  # its setuid program, a tool of the shell
}


_NO_PINS = PinnedImages()


class PullRecord(tuple[str, "pb.AuthConfig | None"]):
    """One pull as ``pulls`` records it: (image, auth), and ``hosts``: the registry hosts (URLs) a
    real pull would have asked for the image's manifest, in order. With the option
    ``registry_config_path`` (a directory of hosts.toml files, read as runv's store reads them,
    :mod:`backends.oci.hosts`, at start and with the same errors): the mirrors, then the server;
    else the image's registry alone."""

    hosts: tuple[str, ...]

    def __new__(cls, image: str, auth: pb.AuthConfig | None, hosts: tuple[str, ...] = ()) -> PullRecord:
        record = super().__new__(cls, (image, auth))
        record.hosts = hosts
        return record


@dataclasses.dataclass(slots=True)
class FakeImage:
    id: str
    repo_tags: list[str]
    repo_digests: list[str]
    size: int
    uid: int | None
    username: str
    pinned: bool = False
    stop_signal: str = ""  # the image config's STOPSIGNAL, as a rule gives it

    def info(self, pinned: PinnedImages = _NO_PINS) -> ImageInfo:
        """As the store reports it, ``pinned`` by ``[images] pinned`` patterns too."""
        return ImageInfo(
            id=self.id,
            repo_tags=tuple(self.repo_tags),
            repo_digests=tuple(self.repo_digests),
            size=self.size,
            uid=self.uid,
            username=self.username,
            pinned=self.pinned or pinned.matches(self.repo_tags, self.repo_digests),
        )


class FakeImages:
    """Pull, list, status, remove and the filesystem figures of the fake's images."""

    def __init__(self, options: Mapping[str, Any], clock: Callable[[], int] = time.time_ns) -> None:
        self.clock = clock
        self.state_dir = str(options.get("state_dir", ""))
        self.pulls: list[PullRecord] = []
        # Parsed now, as runv's store does: a bad hosts.toml stops the start, not a pull.
        self.registry_hosts: Hosts = load_hosts(str(options.get("registry_config_path", "")))
        self._images: dict[str, FakeImage] = {}
        self._pull_seconds = float(options.get("pull_seconds", 0.01))
        self._pause_image = str(options.get("pause_image", ""))
        self._pause_ref = ""
        # The sandbox image is pinned by its flag (it is the image of that tag at start).
        self._pinned = PinnedImages.of([str(p) for p in options.get("pinned", [])])
        self._rules: dict[str, dict[str, Any]] = {}
        for name, rule in dict(options.get("images", {})).items():
            self.add_rule(str(name), dict(rule))
        self._missing = [str(p) for p in options.get("missing_images", [])]
        self.containers: Collection[str] = ()  # the created containers (the lifecycle's), for ImageFsInfo
        self._available = [str(p) for p in options.get("available_images", [])]

    def add_rule(self, name: str, rule: Mapping[str, Any]) -> None:
        """The rule of the image ``name`` (``REPO`` or ``REPO:TAG``), as the ``images`` option
        gives it; ValueError naming what is wrong."""
        files = rule.get("files", {})
        if not isinstance(files, Mapping) or not all(
            isinstance(k, str) and k.startswith("/") and isinstance(v, str) for k, v in files.items()
        ):
            raise ValueError(f"images.{name}.files must be a table of absolute path = text")
        annotations = rule.get("annotations", {})
        if not isinstance(annotations, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in annotations.items()
        ):
            raise ValueError(f"images.{name}.annotations must be a table of name = text")
        for key in ("entrypoint", "cmd"):
            value = rule.get(key, [])
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise ValueError(f"images.{name}.{key} must be a list of strings")
        self._rules[name] = dict(rule)

    def load(self) -> None:
        """Reload the persisted store and pin the sandbox image (at backend start)."""
        if self.state_dir:
            # ImageFsInfo and the writable-layer stats name them: the kubelet stats what they name.
            os.makedirs(self.containers_dir, exist_ok=True)
        self._load()
        if self._pause_image:
            try:
                ref = parse(self._pause_image)
            except BadReference:
                return
            self._pause_ref = ref.tagged
            img = self._images.get(self._image_id(ref)) or self._add(ref)
            img.pinned = True

    # ------------------------------------------------------------------ the Images protocol
    async def pull_image(
        self, image: pb.ImageSpec, auth: pb.AuthConfig | None, sandbox_config: pb.PodSandboxConfig | None
    ) -> str:
        try:
            ref = parse(image.image)
        except BadReference as exc:
            self.pulls.append(PullRecord(image.image, auth))
            if self._pull_seconds:
                await asyncio.sleep(self._pull_seconds)
            raise errors.InvalidArgumentError(str(exc)) from None
        self.pulls.append(PullRecord(image.image, auth, self.hosts_for(ref)))
        if self._pull_seconds:
            await asyncio.sleep(self._pull_seconds)
        if any(fnmatch.fnmatch(ref.name, p) or fnmatch.fnmatch(image.image, p) for p in self._missing):
            raise errors.NotFoundError(f"image {image.image!r} not found in the (fake) registry")
        if not self.available(ref, image.image):
            raise errors.NotFoundError(
                f"image {image.image!r} not found: the (fake) registry has only the images of its "
                "available_images list"
            )
        img = self._add(ref)
        self._save()
        return img.id

    def hosts_for(self, ref: Reference) -> tuple[str, ...]:
        """The hosts a real pull of ``ref`` asks for its manifest, in order: those with the
        ``resolve`` capability for a tag, with ``pull`` for a digest."""
        need = "pull" if ref.digest else "resolve"
        return tuple(
            h.url for h in self.registry_hosts.for_domain(ref.domain) if h.can("pull") and h.can(need)
        )

    async def list_images(self) -> list[ImageInfo]:
        return self.infos()

    def list_images_now(self) -> list[ImageInfo]:
        """Always from memory: the store is memory (so are the two answers below)."""
        return self.infos()

    def infos(self) -> list[ImageInfo]:
        pinned = self._pinned
        return [i.info(pinned) for i in self._images.values()]

    async def image_status(self, image: pb.ImageSpec) -> ImageInfo | None:
        found = self.find(image.image)
        return found.info(self._pinned) if found is not None else None

    async def remove_image(self, image: pb.ImageSpec) -> None:
        found = self.find(image.image)
        if found is not None:
            self._images.pop(found.id, None)
            self._save()

    @property
    def containers_dir(self) -> str:
        """Where the simulated writable layers live: a directory of its own, as a runtime's
        container store apart from its image store ("" without a state directory)."""
        return os.path.join(self.state_dir, "containers") if self.state_dir else ""

    async def image_fs_info(self) -> pb.ImageFsInfoResponse:
        return self.fs_info(len(self.containers))

    def image_fs_info_now(self) -> pb.ImageFsInfoResponse:
        return self.fs_info(len(self.containers))

    def fs_info(self, containers: int) -> pb.ImageFsInfoResponse:
        """ImageFsInfo, with the writable layers of ``containers`` containers."""
        now = self.clock()
        resp = pb.ImageFsInfoResponse()
        if not self.state_dir:
            return resp  # nothing on disk: no filesystem of its own to report
        # The simulated stores are directories that exist (the image store's images.json is in the
        # state directory; the writable layers' is beneath it), which the kubelet can take the
        # filesystem's capacity from; the usage is simulated.
        fs = resp.image_filesystems.add(timestamp=now)
        fs.fs_id.mountpoint = self.state_dir
        fs.used_bytes.value = sum(i.size for i in self._images.values())
        fs.inodes_used.value = len(self._images) * 100
        cfs = resp.container_filesystems.add(timestamp=now)
        cfs.fs_id.mountpoint = self.containers_dir
        cfs.used_bytes.value = 4096 * containers
        cfs.inodes_used.value = 3 * containers
        return resp

    # ------------------------------------------------------------------ lookup
    def find(self, name: str) -> FakeImage | None:
        """The image by ID, unique ID prefix (12+ hex digits), tag or digest reference."""
        img = self._images.get(name) or self._images.get("sha256:" + name)
        if img is not None:
            return img
        if len(name) >= 12 and all(ch in "0123456789abcdef" for ch in name.removeprefix("sha256:")):
            matches = [
                i
                for i in self._images.values()
                if i.id.removeprefix("sha256:").startswith(name.removeprefix("sha256:"))
            ]
            if len(matches) == 1:
                return matches[0]
        try:
            ref = parse(name)
        except BadReference:
            return None
        for img in self._images.values():
            if (ref.digest and ref.name in img.repo_digests) or (
                not ref.digest and ref.tagged in img.repo_tags
            ):
                return img
        return None

    @staticmethod
    def display_name(requested: str, img: FakeImage) -> str:
        """The image as the client named it, normalised, when that name is one of the image's."""
        try:
            name = parse(requested).name
        except BadReference:
            name = ""
        if name in img.repo_tags or name in img.repo_digests:
            return name
        return img.repo_tags[0] if img.repo_tags else requested

    def _image_id(self, ref: Reference) -> str:
        rule = self._rule(ref)
        if "id" in rule:
            return str(rule["id"])
        # All tags of one repository path are one image, except the pinned sandbox
        # image, which stays apart from other tags of its repository.
        if ref.tagged and ref.tagged == self._pause_ref:
            return "sha256:" + hashlib.sha256(ref.tagged.encode()).hexdigest()
        return "sha256:" + hashlib.sha256(ref.path.encode()).hexdigest()

    def available(self, ref: Reference, written: str) -> bool:
        """Whether a pull of ``ref`` (written as ``written``) finds it under ``available_images``."""
        if not self._available or (ref.tagged and ref.tagged == self._pause_ref):
            return True
        return any(fnmatch.fnmatch(ref.name, p) or fnmatch.fnmatch(written, p) for p in self._available)

    def files_for(self, image: str) -> dict[str, bytes]:
        """The files a rule gives the image named ``image`` (its containers start with them)."""
        rule = self._rule_for(image)
        return {path: text.encode() for path, text in dict(rule.get("files", {})).items()}

    def annotations_for(self, image: str) -> dict[str, str]:
        """The annotations a rule gives the image named ``image`` (its manifest's: a checkpoint
        image's ``io.kubernetes.cri-o.annotations.checkpoint.name``)."""
        return {str(k): str(v) for k, v in dict(self._rule_for(image).get("annotations", {})).items()}

    def process_for(self, image: str) -> tuple[list[str], list[str]]:
        """The ENTRYPOINT and CMD a rule gives the image named ``image`` (empty: none)."""
        rule = self._rule_for(image)
        return [str(a) for a in rule.get("entrypoint", [])], [str(a) for a in rule.get("cmd", [])]

    def _rule_for(self, image: str) -> dict[str, Any]:
        """The rule of an image as a container names it: as the pod spec writes it ("busybox:1.36"),
        by its full reference, or by its ID (as the kubelet creates containers), through its tags."""
        rule = self._rules.get(image)
        if rule is not None:
            return rule
        with contextlib.suppress(BadReference):
            rule = self._rule(parse(image))
            if rule:
                return rule
        found = self.find(image)
        for tag in found.repo_tags if found is not None else []:
            with contextlib.suppress(BadReference):
                rule = self._rule(parse(tag))
                if rule:
                    return rule
        return {}

    def _rule(self, ref: Reference) -> dict[str, Any]:
        return (
            self._rules.get(ref.tagged)
            or self._rules.get(ref.repository)
            or BUILTIN_RULES.get(ref.path)
            or {}
        )

    def _add(self, ref: Reference) -> FakeImage:
        iid = self._image_id(ref)
        img = self._images.get(iid)
        rule = self._rule(ref)
        if img is None:
            seed = int(iid[7:15], 16)
            img = FakeImage(
                id=iid,
                repo_tags=[],
                repo_digests=[],
                size=int(rule.get("size", (1 + seed % 64) << 20)),
                uid=int(rule["uid"]) if "uid" in rule else (None if "username" in rule else 0),
                username=str(rule.get("username", "")),
                stop_signal=str(rule.get("stop_signal", "")),
            )
            self._images[iid] = img
        if ref.tag and ref.tagged not in img.repo_tags:
            img.repo_tags.append(ref.tagged)
        digest = ref.digest or "sha256:" + hashlib.sha256(iid.encode()).hexdigest()
        dref = f"{ref.repository}@{digest}"
        if dref not in img.repo_digests:
            img.repo_digests.append(dref)
        return img

    # ------------------------------------------------------------------ persistence
    # The image store is the only state of the fake that must outlive the
    # process: a real runtime keeps its images across a shim restart.
    def _path(self) -> str:
        return os.path.join(self.state_dir, "images.json") if self.state_dir else ""

    def _save(self) -> None:
        path = self._path()
        if not path:
            return
        os.makedirs(self.state_dir, exist_ok=True)
        data = json.dumps([dataclasses.asdict(i) for i in self._images.values()]).encode()
        tmp = path + ".tmp"
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)

    def _load(self) -> None:
        path = self._path()
        if not path or not os.path.exists(path):
            return
        try:
            with open(path, "rb") as f:
                for d in json.loads(f.read()):
                    img = FakeImage(**d)
                    self._images[img.id] = img
        except (OSError, ValueError, TypeError):
            os.replace(path, path + ".corrupt")
