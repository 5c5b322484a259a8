"""Malformed and random requests to every RPC: a clear code each time, never UNKNOWN or INTERNAL.

Requests are random messages of each RPC's request type (random strings,
numbers, repeated and map entries, nested messages), and random mutations
of their encodings (bit flips, truncation, garbage). The seed is fixed, so
a failure reproduces.
"""

from __future__ import annotations

import random

import grpc
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message

from cri_api import api_pb2 as pb
from tests.contract.conftest import Cri

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
