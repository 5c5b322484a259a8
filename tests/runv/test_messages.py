"""The agent protocol's typed messages: wire form, round trips, validation of what arrives."""

from __future__ import annotations

import json
import typing
from typing import Any

import pytest

from backends.contract.usage import Detail, Device, Interface, Sample
from backends.runv.agent import criu, snapshot
from backends.runv.agent import messages as m
from backends.runv.agent.protocol import AgentError
from backends.runv.agent.server import ROUTES

SPEC = m.ContainerSpec(
    args=["sh", "-c", "echo hi"],
    rootfs=m.Rootfs(lowers=["/l/2", "/l/1"], upper="/rw/upper", work="/rw/work"),
    env=["A=1"],
    cwd="/srv",
    user=m.User(name="nobody", gid=65534),
    supplemental_groups=[1, 2],
    tty=True,
    stdin=True,
    add_caps=["CAP_NET_ADMIN"],
    drop_caps=["CAP_ALL"],
    resources=m.ContainerLimits(cpu_quota=50_000, cpu_period=100_000, memory=64 << 20),
    mounts=[m.Mount(source="/shares/a", destination="/data", readonly=True, propagation="rslave")],
    pid_mode="pod",
    seccomp=m.Seccomp(profile={"defaultAction": "SCMP_ACT_ERRNO", "syscalls": [{"names": ["read"]}]}),
)
STATE = m.ContainerState(id="c1", status="exited", pid=7, exit_code=137, finished_at=5, reason="OOMKilled")

MESSAGES: list[m.Message] = [
    m.HelloRequest(),
    m.Hello(version=1, pid=1, containers=2),
    m.SetupRequest(hostname="pod", dns=m.Dns(servers=["10.0.0.10"], searches=["svc"]), sysctls={"a.b": "1"}),
    m.NetworkRequest(interface="rp1", address="10.90.0.5/16", name="eth0", gateway="10.90.0.1", mtu=1500),
    m.NetworkRequest(
        interface="eth0",
        address="10.252.0.5/24",
        more_addresses=["fd00::5/64"],
        routes=[m.Route("default", "10.252.0.1"), m.Route("10.9.0.0/16")],
        mac="0a:58:0a:fc:00:05",
    ),
    m.NetworkResult(name="eth0"),
    m.CreateRequest(id="c1", spec=SPEC),
    m.CreateRequest(id="c2", spec=m.ContainerSpec(args=["true"], rootfs=m.Rootfs(path="/x"))),
    m.Created(pid=42),
    m.StartRequest(id="c1"),
    STATE,
    m.SignalRequest(id="c1", signal=9),
    m.WaitRequest(id="c1"),
    m.StateRequest(id="c1"),
    m.ListRequest(),
    m.ContainerList(containers=[STATE, m.ContainerState(id="c2", status="running")]),
    m.RemoveRequest(id="c1"),
    m.OutputRequest(id="c1", stream=3),
    m.AttachRequest(id="c1", stream=5, stdin=True),
    m.ExecRequest(id="c1", stream=7, args=["ls"], env=["X=y"], stdin=True, tty=True),
    m.ExecReply(exit_code=2),
    m.ExecKillRequest(stream=7, id="c1"),
    m.ResizeRequest(width=80, height=24, stream=7),
    m.UpdateRequest(id="c1", resources=m.ContainerLimits(cpu_shares=512)),
    m.StatsRequest(id="c1"),
    m.StatsReply(cpu_ns=1, memory_bytes=2, working_set_bytes=3),
    m.MetricsRequest(ids=["c1", "c2"]),
    m.MetricsReply(
        containers={
            "c1": m.ContainerMetrics(
                sample=Sample(timestamp=9, cpu_ns=10, memory_usage=None),
                detail=Detail(processes=3, devices=(Device(major=8, minor=0, reads=4),)),
            ),
            "c2": m.ContainerMetrics(sample=Sample(timestamp=9)),
        },
        interfaces=[Interface(name="eth0", rx_bytes=1, rx_errors=0, tx_bytes=2, tx_errors=0)],
    ),
    m.PortForwardRequest(port=8080, stream=9),
    m.ShutdownRequest(),
    m.Empty(),
]


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda msg: type(msg).__name__)
def test_round_trip_through_json(msg: m.Message) -> None:
    wire = json.loads(json.dumps(msg.to_dict()))
    assert type(msg).from_dict(wire) == msg


def test_wire_form_is_the_documented_json() -> None:
    """PROTOCOL.md's field names and shapes: what a version-1 peer without these classes sends."""
    assert m.ExecRequest(id="c", stream=3, args=["ls"]).to_dict() == {
        "id": "c",
        "stream": 3,
        "args": ["ls"],
        "env": [],
        "stdin": False,
        "tty": False,
    }
    assert m.SetupRequest(hostname="h").to_dict() == {
        "hostname": "h",
        "dns": {"servers": [], "searches": [], "options": []},
        "sysctls": {},
    }
    spec = m.CreateRequest(id="c", spec=SPEC).to_dict()["spec"]
    assert spec["rootfs"] == {
        "lowers": ["/l/2", "/l/1"],
        "upper": "/rw/upper",
        "work": "/rw/work",
        "path": "",
    }
    assert spec["user"] == {"uid": None, "name": "nobody", "gid": 65534, "group": ""}
    assert spec["mounts"] == [
        {
            "source": "/shares/a",
            "destination": "/data",
            "readonly": True,
            "propagation": "rslave",
            "recursive_readonly": False,
            "options": [],
            "image_lowers": [],
            "image_sub_path": "",
        }
    ]
    metrics = MESSAGES[-4].to_dict()
    assert metrics["containers"]["c1"]["detail"]["devices"][0]["major"] == 8
    assert metrics["interfaces"][0]["name"] == "eth0"


def test_a_minimal_peer_message_gets_the_defaults() -> None:
    """Optional fields may be absent (an older host), unknown ones are ignored (a newer one)."""
    req = m.CreateRequest.from_dict({"id": "c", "spec": {"args": ["true"], "rootfs": {"path": "/r"}}, "x": 1})
    assert req == m.CreateRequest(id="c", spec=m.ContainerSpec(args=["true"], rootfs=m.Rootfs(path="/r")))
    assert req.spec.pid_mode == "container" and req.spec.seccomp is None
    assert m.Seccomp.from_dict({"default": True}) == m.Seccomp(default=True)
    assert m.StatsReply.from_dict({"cpu_ns": 5}) == m.StatsReply(cpu_ns=5)


@pytest.mark.parametrize(
    ("cls", "data", "error"),
    [
        (m.StartRequest, {}, "id: missing"),
        (m.StartRequest, ["id"], "StartRequest: expected object, got list"),
        (m.StartRequest, {"id": None}, "id: expected str, got null"),
        (m.SignalRequest, {"id": "c", "signal": 9.0}, "signal: expected int, got float"),
        (m.AttachRequest, {"id": "c", "stream": 1, "stdin": 1}, "stdin: expected bool, got int"),
        (m.ExecRequest, {"id": "c", "stream": 1, "args": "ls"}, "args: expected list, got str"),
        (m.CreateRequest, {"id": "c"}, "spec: missing"),
        (m.CreateRequest, {"id": "c", "spec": {}}, "spec.args: missing"),
        (
            m.CreateRequest,
            {"id": "c", "spec": {"args": [], "mounts": [{"source": "/a"}]}},
            "spec.mounts[0].destination: missing",
        ),
        (
            m.CreateRequest,
            {"id": "c", "spec": {"args": [], "user": {"uid": "0"}}},
            "spec.user.uid: expected int, got str",
        ),
        (m.SetupRequest, {"dns": {"servers": "1.1.1.1"}}, "dns.servers: expected list, got str"),
        (m.MetricsReply, {"containers": {"c1": {"sample": {}}}}, "containers.c1.sample.timestamp: missing"),
    ],
    ids=[
        "missing",
        "not-an-object",
        "null",
        "float-for-int",
        "int-for-bool",
        "str-for-list",
        "missing-object",
        "missing-nested",
        "missing-in-list-item",
        "nested-wrong-type",
        "nested-list",
        "result-nested-foreign-type",
    ],
)
def test_validation_names_the_field(cls: type[m.Message], data: Any, error: str) -> None:
    with pytest.raises(AgentError) as info:
        cls.from_dict(data)
    assert info.value.code == "invalid"
    assert info.value.message == error


def test_every_operation_has_a_route_and_a_matching_result_type() -> None:
    # The messages of the wire protocol, the template's two (agent/snapshot.py) and the
    # checkpoints' three (agent/criu.py).
    requests = (
        *m.REQUESTS,
        snapshot.SaveRequest,
        snapshot.RestoredRequest,
        criu.CheckpointRequest,
        criu.ThawRequest,
        criu.RestorePrepareRequest,
    )
    assert {r.OP for r in requests} == set(ROUTES)
    assert len({r.OP for r in requests}) == len(requests)
    for req in requests:
        assert ROUTES[req.OP][0] is req
        (base,) = [b for b in req.__orig_bases__ if typing.get_origin(b) is m.Request]  # type: ignore[attr-defined]
        assert typing.get_args(base) == (req.RESULT,), req.OP


def test_typed_result_of_a_request() -> None:
    assert m.StartRequest(id="c1").result(STATE.to_dict()) == STATE
    with pytest.raises(AgentError, match="status: missing"):
        m.WaitRequest(id="c1").result({"id": "c1"})
