"""Malformed and random requests to every RPC: a clear code each time, never UNKNOWN or INTERNAL.

Requests are random messages of each RPC's request type (random strings,
numbers, repeated and map entries, nested messages), and random mutations
of their encodings (bit flips, truncation, garbage). The seed is fixed, so
a failure reproduces.
"""

from __future__ import annotations

import io
import os
import random
import tarfile

import grpc
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message

from cri_api import api_pb2 as pb
from tests.contract.conftest import Cri
from tests.criutil import container_config, sandbox_config

ALLOWED = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.ALREADY_EXISTS,
    grpc.StatusCode.UNIMPLEMENTED,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.UNAVAILABLE,  # e.g. a random image name on a registry this machine cannot reach
}
STRINGS = [
    "",
    "a",
    "busybox",
    "../../etc/passwd",
    "x" * 300,
    "\u00e9\u4e2d",
    "0" * 64,
    "/abs",
    "sha256:" + "a" * 64,
    # Paths a checkpoint may not be written to or read from (CheckpointContainer, CheckpointPod,
    # RestorePod): relative, a directory, the kernel's files, the root.
    "relative/c.tar",
    "/tmp",
    "/proc/self/c.tar",
    "/",
    # An image that is a checkpoint archive (CreateContainer), here one that does not exist.
    "/var/lib/kubelet/checkpoints/checkpoint-pod_default-ctr-2026-07-23T10:00:00Z.tar",
]


def random_message(cls: type[Message], rnd: random.Random, depth: int = 0) -> Message:
    msg = cls()
    fill(msg, msg.DESCRIPTOR, rnd, depth)
    return msg


def random_scalar(f: FieldDescriptor, rnd: random.Random) -> object:
    t = f.type
    if t == FieldDescriptor.TYPE_STRING:
        return rnd.choice(STRINGS)
    if t == FieldDescriptor.TYPE_BYTES:
        return rnd.randbytes(rnd.randint(0, 20))
    if t == FieldDescriptor.TYPE_BOOL:
        return rnd.random() < 0.5
    if t == FieldDescriptor.TYPE_ENUM:
        return rnd.choice([v.number for v in f.enum_type.values])
    if t in (FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT):
        return rnd.choice([0.0, -1.0, 1e300, 3.5])
    if t in (
        FieldDescriptor.TYPE_UINT32,
        FieldDescriptor.TYPE_UINT64,
        FieldDescriptor.TYPE_FIXED32,
        FieldDescriptor.TYPE_FIXED64,
    ):
        return rnd.choice(
            [
                0,
                1,
                80,
                2**31 - 1 if t in (FieldDescriptor.TYPE_UINT32, FieldDescriptor.TYPE_FIXED32) else 2**63,
            ]
        )
    if t in (FieldDescriptor.TYPE_INT32, FieldDescriptor.TYPE_SINT32, FieldDescriptor.TYPE_SFIXED32):
        return rnd.choice([0, -1, 1, 2**31 - 1, -(2**31)])
    return rnd.choice([0, -1, 1, 2**62, -(2**63)])


def fill(msg: Message, desc: Descriptor, rnd: random.Random, depth: int) -> None:
    for f in desc.fields:
        if rnd.random() < 0.4:
            continue
        if f.message_type is not None and f.message_type.GetOptions().map_entry:
            m = getattr(msg, f.name)
            for _ in range(rnd.randint(0, 3)):
                key = rnd.choice(STRINGS)
                vf = f.message_type.fields_by_name["value"]
                if vf.message_type is not None:
                    if depth < 3:
                        fill(m[key], vf.message_type, rnd, depth + 1)
                else:
                    m[key] = random_scalar(vf, rnd)
        elif f.is_repeated:
            rep = getattr(msg, f.name)
            for _ in range(rnd.randint(0, 3)):
                if f.message_type is not None:
                    if depth < 3:
                        fill(rep.add(), f.message_type, rnd, depth + 1)
                else:
                    rep.append(random_scalar(f, rnd))
        elif f.message_type is not None:
            if depth < 3:
                sub = getattr(msg, f.name)
                sub.SetInParent()
                fill(sub, f.message_type, rnd, depth + 1)
        else:
            setattr(msg, f.name, random_scalar(f, rnd))


def mutate(data: bytes, rnd: random.Random) -> bytes:
    choice = rnd.randint(0, 3)
    if not data or choice == 0:
        return rnd.randbytes(rnd.randint(1, 64))
    b = bytearray(data)
    if choice == 1:
        for _ in range(rnd.randint(1, 4)):
            b[rnd.randrange(len(b))] ^= 1 << rnd.randrange(8)
        return bytes(b)
    if choice == 2:
        return bytes(b[: rnd.randrange(len(b))])
    return bytes(b) + rnd.randbytes(rnd.randint(1, 16))


async def test_fuzz_every_unary_rpc(cri: Cri) -> None:
    rnd = random.Random(20261130)
    ch = cri.channel
    await cri.im.PullImage(pb.PullImageRequest(image=pb.ImageSpec(image=cri.image)))
    for service in ("RuntimeService", "ImageService"):
        sd = pb.DESCRIPTOR.services_by_name[service]
        for method in sd.methods:
            if method.server_streaming:
                continue
            cls = pb.__dict__[method.input_type.name]
            call = ch.unary_unary(
                f"/runtime.v1.{service}/{method.name}",
                request_serializer=lambda b: b,
                response_deserializer=lambda b: b,
            )
            for i in range(25):
                data = random_message(cls, rnd).SerializeToString()
                if i % 2:
                    data = mutate(data, rnd)
                try:
                    await call(data, timeout=10)
                    code = grpc.StatusCode.OK
                except grpc.aio.AioRpcError as exc:
                    code = exc.code()
                    assert "Traceback" not in (exc.details() or "")
                assert code in ALLOWED, (method.name, code, data)
    # Still serving, and consistent.
    assert (await cri.rt.Version(pb.VersionRequest())).runtime_name == "cri-shim"
    pods = (await cri.rt.ListPodSandbox(pb.ListPodSandboxRequest())).items
    for p in pods:
        await cri.rt.RemovePodSandbox(pb.RemovePodSandboxRequest(pod_sandbox_id=p.id))
    assert len((await cri.rt.ListContainers(pb.ListContainersRequest())).containers) == 0


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _tar(members: dict[str, bytes], kind: bytes = tarfile.REGTYPE) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.type = kind
            info.size = len(data) if kind == tarfile.REGTYPE else 0
            tar.addfile(info, io.BytesIO(data) if kind == tarfile.REGTYPE else None)
    return out.getvalue()


# Archives no backend may restore a pod from, whatever it writes: each is refused with a clear
# code, and nothing is left behind.
BAD_ARCHIVES: dict[str, bytes] = {
    "empty": b"",
    "garbage": bytes(range(256)) * 4,
    "gzip-header": b"\x1f\x8b\x08\x00" + b"\x00" * 60,
    "foreign-tar": _tar({"etc/passwd": b"root:x:0:0::/root:/bin/sh\n"}),
    "escaping-member": _tar({"../../escaped": b"x", "manifest.json": b"{}"}),
    "absolute-member": _tar({"/etc/cron.d/x": b"x"}),
    "symlink-member": _tar({"manifest.json": b""}, tarfile.SYMTYPE),
    "manifest-not-json": _tar({"manifest.json": b"{", "manifest.sha256": b"0" * 64}),
    "manifest-foreign": _tar({"manifest.json": b'{"format": "criu/9"}', "manifest.sha256": b"x"}),
}


async def test_fuzz_restore_pod_archives(cri: Cri, short_tmp: str) -> None:
    """RestorePod from malformed checkpoints: the fixed corpus above, and random mutations (bit
    flips, truncation, garbage) of the checkpoint this backend wrote of a pod (of a foreign
    archive where it writes none). Never UNKNOWN or INTERNAL, never a pod left behind."""
    rnd = random.Random(20261207)
    await cri.im.PullImage(pb.PullImageRequest(image=pb.ImageSpec(image=cri.image)))
    sc = sandbox_config(name="ckpt", log_directory=os.path.join(short_tmp, "logs"))
    pod = (await cri.rt.RunPodSandbox(pb.RunPodSandboxRequest(config=sc))).pod_sandbox_id
    cc = container_config(image=cri.image, command=["sleep", "1000"], log_path="c.log")
    req = pb.CreateContainerRequest(pod_sandbox_id=pod, config=cc, sandbox_config=sc)
    cid = (await cri.rt.CreateContainer(req)).container_id
    await cri.rt.StartContainer(pb.StartContainerRequest(container_id=cid))
    written = os.path.join(short_tmp, "written")
    os.mkdir(written)
    try:
        await cri.rt.CheckpointPod(
            pb.CheckpointPodRequest(pod_sandbox_id=pod, output_path=written, container_ids=[cid]), timeout=30
        )
    except grpc.aio.AioRpcError as exc:
        assert exc.code() in (grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.FAILED_PRECONDITION), exc
        assert os.listdir(written) == []  # refused: nothing written
    originals = {name: _read(os.path.join(written, name)) for name in os.listdir(written)}
    if not originals:
        originals = {"pod.tar": BAD_ARCHIVES["foreign-tar"]}
    corpus = [{name: data for name in originals} for data in BAD_ARCHIVES.values()]
    for _ in range(30):
        corpus.append({name: mutate(data, rnd) for name, data in originals.items()})
    restore_config = sandbox_config(name="restored", log_directory=os.path.join(short_tmp, "logs2"))
    before = sorted(p.id for p in (await cri.rt.ListPodSandbox(pb.ListPodSandboxRequest())).items)
    for i, files in enumerate(corpus):
        where = os.path.join(short_tmp, f"bad-{i}")
        os.mkdir(where)
        for name, data in files.items():
            with open(os.path.join(where, name), "wb") as f:
                f.write(data)
        request = pb.RestorePodRequest(checkpoint_path=where, config=restore_config, container_configs=[cc])
        try:
            got = await cri.rt.RestorePod(request, timeout=30)
            code = grpc.StatusCode.OK  # a flip the format does not read (tar padding): still verified
            await cri.rt.RemovePodSandbox(pb.RemovePodSandboxRequest(pod_sandbox_id=got.pod_sandbox_id))
        except grpc.aio.AioRpcError as exc:
            code = exc.code()
            assert "Traceback" not in (exc.details() or "")
        assert code in ALLOWED - {grpc.StatusCode.UNAVAILABLE}, (i, code)
        after = sorted(p.id for p in (await cri.rt.ListPodSandbox(pb.ListPodSandboxRequest())).items)
        assert after == before, i
        assert {n: _read(os.path.join(where, n)) for n in os.listdir(where)} == files  # read only
    await cri.rt.RemovePodSandbox(pb.RemovePodSandboxRequest(pod_sandbox_id=pod))


async def _running_container(cri: Cri, root: str, name: str) -> tuple[str, str, pb.PodSandboxConfig]:
    await cri.im.PullImage(pb.PullImageRequest(image=pb.ImageSpec(image=cri.image)))
    sc = sandbox_config(name=name, log_directory=os.path.join(root, f"logs-{name}"))
    pod = (await cri.rt.RunPodSandbox(pb.RunPodSandboxRequest(config=sc))).pod_sandbox_id
    cc = container_config(image=cri.image, command=["sleep", "1000"], log_path="c.log")
    req = pb.CreateContainerRequest(pod_sandbox_id=pod, config=cc, sandbox_config=sc)
    cid = (await cri.rt.CreateContainer(req)).container_id
    await cri.rt.StartContainer(pb.StartContainerRequest(container_id=cid))
    return pod, cid, sc


async def _code(call: object) -> grpc.StatusCode:
    try:
        await call  # type: ignore[misc]
    except grpc.aio.AioRpcError as exc:
        assert "Traceback" not in (exc.details() or "")
        return exc.code()
    return grpc.StatusCode.OK


async def test_fuzz_create_from_checkpoint_archives(cri: Cri, short_tmp: str) -> None:
    """CreateContainer whose image is a malformed checkpoint archive: the fixed corpus above, and
    random mutations of the archive this backend's CheckpointContainer wrote (of a foreign one
    where it writes none). Refused with a clear code (INVALID_ARGUMENT; docker and runv:
    FAILED_PRECONDITION, CRIU), the archive unchanged, no container left behind."""
    rnd = random.Random(20261208)
    pod, cid, sc = await _running_container(cri, short_tmp, "ckpt")
    written = os.path.join(short_tmp, "written.tar")
    try:
        req = pb.CheckpointContainerRequest(container_id=cid, location=written)
        await cri.rt.CheckpointContainer(req, timeout=30)
    except grpc.aio.AioRpcError as exc:
        assert exc.code() in (grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.FAILED_PRECONDITION), exc
        assert not os.path.exists(written)
    original = _read(written) if os.path.exists(written) else BAD_ARCHIVES["foreign-tar"]
    corpus = list(BAD_ARCHIVES.values()) + [mutate(original, rnd) for _ in range(30)]
    before = sorted(c.id for c in (await cri.rt.ListContainers(pb.ListContainersRequest())).containers)
    for i, data in enumerate(corpus):
        path = os.path.join(short_tmp, f"bad-{i}.tar")
        with open(path, "wb") as f:
            f.write(data)
        cc = container_config(name=f"restored-{i}", image=path, log_path=f"r{i}.log")
        got = await _code(
            cri.rt.CreateContainer(
                pb.CreateContainerRequest(pod_sandbox_id=pod, config=cc, sandbox_config=sc)
            )
        )
        if got == grpc.StatusCode.OK:  # a flip the format does not read (tar padding): still verified
            listed = (await cri.rt.ListContainers(pb.ListContainersRequest())).containers
            for c in listed:
                if c.id not in before:
                    await cri.rt.RemoveContainer(pb.RemoveContainerRequest(container_id=c.id))
        else:
            assert got in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION), (i, got)
        after = sorted(c.id for c in (await cri.rt.ListContainers(pb.ListContainersRequest())).containers)
        assert after == before, i
        assert _read(path) == data, i  # read only


async def test_malformed_checkpoint_requests(cri: Cri, short_tmp: str) -> None:
    """CheckpointContainer and CheckpointPod on what may not be checkpointed, or where nothing may
    be written: a clear code each, nothing written, the pod and its containers as they were."""
    pod, cid, sc = await _running_container(cri, short_tmp, "target")
    cc = container_config(name="idle", image=cri.image, command=["sleep", "1000"], log_path="i.log")
    idle = (
        await cri.rt.CreateContainer(
            pb.CreateContainerRequest(pod_sandbox_id=pod, config=cc, sandbox_config=sc)
        )
    ).container_id
    stopped = (
        await cri.rt.CreateContainer(
            pb.CreateContainerRequest(
                pod_sandbox_id=pod,
                config=container_config(
                    name="stopped", image=cri.image, command=["sleep", "1000"], log_path="s.log"
                ),
                sandbox_config=sc,
            )
        )
    ).container_id
    await cri.rt.StartContainer(pb.StartContainerRequest(container_id=stopped))
    await cri.rt.StopContainer(pb.StopContainerRequest(container_id=stopped, timeout=0))
    out = os.path.join(short_tmp, "out")
    os.mkdir(out)
    full = os.path.join(short_tmp, "full")
    os.mkdir(full)
    with open(os.path.join(full, "x"), "w") as f:
        f.write("x")
    at = os.path.join(out, "c.tar")
    IA, NF, FP = (
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.FAILED_PRECONDITION,
    )
    containers = [
        (pb.CheckpointContainerRequest(container_id=cid, location="relative/c.tar"), {IA}),
        (pb.CheckpointContainerRequest(container_id=cid, location=out + "/../out/c.tar"), {IA}),
        (pb.CheckpointContainerRequest(container_id=cid, location=out + "//c.tar"), {IA}),
        (pb.CheckpointContainerRequest(container_id=cid, location="/proc/self/c.tar"), {IA}),
        (pb.CheckpointContainerRequest(container_id=cid, location="/sys/c.tar"), {IA}),
        (pb.CheckpointContainerRequest(container_id=cid, location="/"), {IA}),
        (pb.CheckpointContainerRequest(container_id=cid, location=out), {IA}),
        (pb.CheckpointContainerRequest(container_id=cid, location=out + "/missing/c.tar"), {IA}),
        (
            pb.CheckpointContainerRequest(container_id=cid, location=out + "/c\x00.tar"),
            {IA},
        ),
        (
            pb.CheckpointContainerRequest(
                container_id=cid, location=os.path.join(short_tmp, "state", "c.tar")
            ),
            {IA},
        ),
        (pb.CheckpointContainerRequest(container_id=cid, location=at, timeout=-1), {IA}),
        (pb.CheckpointContainerRequest(container_id="", location=at), {IA}),
        (pb.CheckpointContainerRequest(container_id="f" * 64, location=at), {NF}),
        (pb.CheckpointContainerRequest(container_id=idle, location=at), {FP}),
        (pb.CheckpointContainerRequest(container_id=stopped, location=at), {FP}),
    ]
    pods = [
        (pb.CheckpointPodRequest(pod_sandbox_id="f" * 64, output_path=out, container_ids=[cid]), {NF}),
        (pb.CheckpointPodRequest(pod_sandbox_id="", output_path=out, container_ids=[cid]), {IA}),
        (pb.CheckpointPodRequest(pod_sandbox_id=pod, output_path=full, container_ids=[cid]), {IA}),
        (pb.CheckpointPodRequest(pod_sandbox_id=pod, output_path="/dev", container_ids=[cid]), {IA}),
        (pb.CheckpointPodRequest(pod_sandbox_id=pod, output_path=out, container_ids=[]), {IA}),
        (pb.CheckpointPodRequest(pod_sandbox_id=pod, output_path=out, container_ids=[cid, cid]), {IA}),
        (pb.CheckpointPodRequest(pod_sandbox_id=pod, output_path=out, container_ids=[cid, stopped]), {FP}),
        (pb.CheckpointPodRequest(pod_sandbox_id=pod, output_path=out, container_ids=["e" * 64]), {NF}),
    ]
    for req, codes in containers:
        got = await _code(cri.rt.CheckpointContainer(req, timeout=30))
        assert got in codes, (req, got)
    for req, codes in pods:
        got = await _code(cri.rt.CheckpointPod(req, timeout=30))
        assert got in codes, (req, got)
    assert os.listdir(out) == [] and os.listdir(full) == ["x"]
    states = {c.id: c.state for c in (await cri.rt.ListContainers(pb.ListContainersRequest())).containers}
    assert states == {cid: pb.CONTAINER_RUNNING, idle: pb.CONTAINER_CREATED, stopped: pb.CONTAINER_EXITED}
