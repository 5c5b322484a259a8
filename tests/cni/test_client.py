"""ADD, CHECK, DEL, STATUS and GC over fake plugins: chaining, order, cache, clean-up, ordering."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from backends.cni import (
    Attachment,
    ConfigError,
    GcError,
    PluginError,
    PluginTimeoutError,
    PortMapping,
    ResultError,
)
from backends.contract.errors import AlreadyExistsError, NotFoundError
from tests.cni.conftest import Env

POD = Attachment(
    "sandbox1",
    "/proc/self/ns/net",
    pod_namespace="default",
    pod_name="web",
    pod_uid="uid-1",
    port_mappings=(PortMapping(8080, 80), PortMapping(0, 81)),
)
ARGS = "IgnoreUnknown=1;K8S_POD_NAMESPACE=default;K8S_POD_NAME=web;K8S_POD_INFRA_CONTAINER_ID=sandbox1;K8S_POD_UID=uid-1"
MAPPINGS = [{"hostPort": 8080, "containerPort": 80, "protocol": "tcp"}]


def chain(env: Env, version: str = "1.0.0", name: str = "net1", **over: dict[str, Any]) -> dict[str, Any]:
    """main (an interface plugin), tune (passes prevResult on), portmap (declares portMappings)."""
    env.plugins("main", "tune", "portmap")
    return {
        "cniVersion": version,
        "name": name,
        "plugins": [
            env.plugin("main", **over.get("main", {})),
            env.plugin("tune", **over.get("tune", {})),
            env.plugin("portmap", **over.get("portmap", {})) | {"capabilities": {"portMappings": True}},
        ],
    }


def seen(env: Env) -> list[tuple[str, str]]:
    return [(c["env"]["CNI_COMMAND"], c["plugin"]) for c in env.calls()]


def cache_files(env: Env) -> list[str]:
    return sorted(str(p.relative_to(env.cache_dir)) for p in env.cache_dir.rglob("*.json"))


async def test_add_chains_the_results_and_caches_the_last(env: Env) -> None:
    env.write(
        chain(env, tune={"ADD": {"result": {"cniVersion": "1.0.0", "ips": [{"address": "10.9.0.9/24"}]}}})
    )
    result = await env.client().add(POD)
    assert seen(env) == [("ADD", "main"), ("ADD", "tune"), ("ADD", "portmap")]
    main, tune, portmap = env.calls()
    assert "prevResult" not in main["stdin"]
    assert tune["stdin"]["prevResult"]["ips"] == [{"address": "10.88.0.2/24", "interface": 0}]
    assert portmap["stdin"]["prevResult"] == {"cniVersion": "1.0.0", "ips": [{"address": "10.9.0.9/24"}]}
    assert "runtimeConfig" not in main["stdin"] and "runtimeConfig" not in tune["stdin"]
    assert portmap["stdin"]["runtimeConfig"] == {"portMappings": MAPPINGS}
    assert "capabilities" not in portmap["stdin"]
    assert {c["env"]["CNI_ARGS"] for c in env.calls()} == {ARGS}
    assert {c["env"]["CNI_NETNS"] for c in env.calls()} == {"/proc/self/ns/net"}
    assert [str(ip) for ip in result.pod_addresses("eth0").ordered()] == ["10.9.0.9"]
    assert cache_files(env) == ["net1/sandbox1/eth0.json"]
    cached = json.loads((env.cache_dir / "net1/sandbox1/eth0.json").read_text())
    assert cached["result"] == dict(result.raw)
    assert cached["cniArgs"] == ARGS
    assert cached["runtimeConfig"] == {"portMappings": MAPPINGS}
    assert cached["config"]["plugins"][2]["type"] == "portmap"
    assert env.client().cached_result("sandbox1") == result  # read back after a "restart"


async def test_add_twice_without_del_is_refused(env: Env) -> None:
    env.write(chain(env))
    client = env.client()
    await client.add(POD)
    with pytest.raises(AlreadyExistsError, match="sandbox1/eth0"):
        await client.add(POD)


@pytest.mark.parametrize(
    ("over", "error"),
    [
        ({"tune": {"ADD": {"error": {"code": 7, "msg": "bad sysctl"}}}}, PluginError),
        ({"tune": {"ADD": {"stdout": "not json"}}}, ResultError),
        ({"tune": {"ADD": {"result": {"ips": [{"address": "10.0.0.1"}]}}}}, ResultError),
    ],
    ids=["plugin-error", "result-not-json", "result-malformed"],
)
async def test_a_failed_add_deletes_the_whole_chain(env: Env, over: dict[str, Any], error: type) -> None:
    env.write(chain(env, **over))
    with pytest.raises(error, match="tune"):
        await env.client().add(POD)
    assert seen(env) == [
        ("ADD", "main"),
        ("ADD", "tune"),
        ("DEL", "portmap"),
        ("DEL", "tune"),
        ("DEL", "main"),
    ]
    # No prevResult: the ADD has no final result.
    assert all("prevResult" not in c["stdin"] for c in env.calls()[2:])
    assert env.calls()[2]["stdin"]["runtimeConfig"] == {"portMappings": MAPPINGS}
    assert cache_files(env) == []


async def test_a_timed_out_add_is_deleted_too(env: Env, tmp_path: Path) -> None:
    env.write(chain(env, portmap={"ADD": {"hang": str(tmp_path / "pids")}}))
    with pytest.raises(PluginTimeoutError, match="portmap ADD"):
        await env.client(plugin_timeout=1.0).add(POD)
    assert seen(env)[-3:] == [("DEL", "portmap"), ("DEL", "tune"), ("DEL", "main")]
    assert cache_files(env) == []


async def test_a_failed_undo_keeps_the_entry_for_a_later_del(env: Env) -> None:
    env.write(
        chain(
            env, tune={"ADD": {"error": {"code": 7, "msg": "x"}}, "DEL": {"error": {"code": 5, "msg": "io"}}}
        )
    )
    client = env.client()
    with pytest.raises(PluginError, match="code 7"):
        await client.add(POD)
    assert cache_files(env) == ["net1/sandbox1/eth0.json"]
    (env.bin_dir / "tune").write_text("#!/bin/sh\ncat >/dev/null\n")  # the plugin recovers
    await client.delete(POD)
    assert seen(env)[-2:] == [("DEL", "portmap"), ("DEL", "main")]
    assert cache_files(env) == []


async def test_del_runs_in_reverse_with_the_cached_result_config_and_args(env: Env) -> None:
    env.write(chain(env))
    result = await env.client().add(POD)
    env.log.unlink()
    # A restart, the config renamed and changed, the pod's own arguments not given again.
    env.write(chain(env, name="other", version="1.1.0"))
    await env.client().delete(Attachment("sandbox1", "/proc/self/ns/net"))
    assert seen(env) == [("DEL", "portmap"), ("DEL", "tune"), ("DEL", "main")]
    for call in env.calls():
        assert call["stdin"]["name"] == "net1"
        assert call["stdin"]["cniVersion"] == "1.0.0"
        assert call["stdin"]["prevResult"] == dict(result.raw)
        assert call["env"]["CNI_ARGS"] == ARGS
    assert env.calls()[0]["stdin"]["runtimeConfig"] == {"portMappings": MAPPINGS}
    assert cache_files(env) == []
    await env.client().delete(POD)  # done twice is done: no plugin runs
    assert len(env.calls()) == 3


async def test_del_works_after_the_config_was_removed(env: Env) -> None:
    path = env.write(chain(env))
    await env.client().add(POD)
    path.unlink()
    await env.client().delete(POD)
    assert seen(env)[3:] == [("DEL", "portmap"), ("DEL", "tune"), ("DEL", "main")]
    assert cache_files(env) == []


async def test_del_of_0_3_1_sends_no_prev_result(env: Env) -> None:
    env.write(chain(env, version="0.3.1"))
    await env.client().add(POD)
    await env.client().delete(POD)
    assert all("prevResult" not in c["stdin"] for c in env.calls()[3:])


async def test_del_tolerates_a_gone_netns_a_gone_plugin_and_unknown_container(
    env: Env, tmp_path: Path
) -> None:
    netns = tmp_path / "netns"
    netns.touch()
    env.write(chain(env, main={"DEL": {"error": {"code": 3, "msg": "container unknown"}}}))
    pod = Attachment("sandbox1", str(netns))
    await env.client().add(pod)
    netns.unlink()
    (env.bin_dir / "tune").unlink()
    await env.client().delete(pod)
    assert seen(env)[3:] == [("DEL", "portmap"), ("DEL", "main")]
    assert "CNI_NETNS" not in env.calls()[3]["env"]
    assert cache_files(env) == []


async def test_a_failing_del_keeps_the_entry(env: Env) -> None:
    env.write(chain(env, tune={"DEL": {"error": {"code": 11, "msg": "busy"}}}))
    await env.client().add(POD)
    with pytest.raises(PluginError, match=r"tune DEL failed \(code 11\): busy"):
        await env.client().delete(POD)
    assert seen(env)[3:] == [("DEL", "portmap"), ("DEL", "tune")]
    assert cache_files(env) == ["net1/sandbox1/eth0.json"]


async def test_each_interface_is_its_own_attachment(env: Env) -> None:
    env.write(chain(env))
    client = env.client()
    await client.add(POD)
    net1 = Attachment("sandbox1", "/proc/self/ns/net", ifname="net1")
    await client.add(net1)
    await client.delete(net1)
    assert cache_files(env) == ["net1/sandbox1/eth0.json"]
    assert {c["env"]["CNI_IFNAME"] for c in env.calls()[3:]} == {"net1"}


async def test_check_runs_in_order_with_the_cached_result(env: Env) -> None:
    env.write(chain(env, version="0.4.0"))
    client = env.client()
    with pytest.raises(NotFoundError):
        await client.check(POD)
    result = await client.add(POD)
    await client.check(POD)
    assert seen(env)[3:] == [("CHECK", "main"), ("CHECK", "tune"), ("CHECK", "portmap")]
    assert all(c["stdin"]["prevResult"] == dict(result.raw) for c in env.calls()[3:])


@pytest.mark.parametrize(
    ("version", "extra"), [("0.3.1", {}), ("1.0.0", {"disableCheck": True})], ids=["0.3.1", "disabled"]
)
async def test_check_is_not_run_where_the_config_has_none(
    env: Env, version: str, extra: dict[str, Any]
) -> None:
    env.write(chain(env, version=version) | extra)
    client = env.client()
    await client.add(POD)
    await client.check(POD)
    assert [cmd for cmd, _ in seen(env)] == ["ADD"] * 3


async def test_a_failed_check_says_which_plugin(env: Env) -> None:
    env.write(chain(env, tune={"CHECK": {"error": {"code": 102, "msg": "veth gone"}}}))
    client = env.client()
    await client.add(POD)
    with pytest.raises(PluginError, match="tune CHECK failed"):
        await client.check(POD)


async def test_status_asks_every_plugin_from_1_1_0(env: Env) -> None:
    env.write(chain(env, version="1.1.0", portmap={"STATUS": {"error": {"code": 50, "msg": "no daemon"}}}))
    client = env.client()
    with pytest.raises(PluginError, match=r"portmap STATUS failed \(code 50\)"):
        await client.status()
    assert seen(env) == [("STATUS", "main"), ("STATUS", "tune"), ("STATUS", "portmap")]
    assert set(env.calls()[0]["env"]) == {"CNI_COMMAND", "CNI_PATH"}
    env.log.unlink()
    env.write(chain(env, version="1.0.0"))
    await client.status()
    assert seen(env) == []


async def test_gc_deletes_stale_attachments_and_passes_the_valid_ones(env: Env) -> None:
    env.write(chain(env, version="1.1.0"))
    client = env.client()
    keep = Attachment("keep1", "/proc/self/ns/net")
    stale = Attachment("stale1", "/proc/self/ns/net")
    await client.add(keep)
    await client.add(stale)
    env.log.unlink()
    await client.gc([("keep1", "eth0"), ("other", "eth1")])
    assert seen(env) == [
        ("DEL", "portmap"),
        ("DEL", "tune"),
        ("DEL", "main"),
        ("GC", "main"),
        ("GC", "tune"),
        ("GC", "portmap"),
    ]
    assert {c["env"]["CNI_CONTAINERID"] for c in env.calls()[:3]} == {"stale1"}
    gc = env.calls()[3]
    assert gc["stdin"]["cni.dev/valid-attachments"] == [
        {"containerID": "keep1", "ifname": "eth0"},
        {"containerID": "other", "ifname": "eth1"},
    ]
    assert set(gc["env"]) == {"CNI_COMMAND", "CNI_PATH"}
    assert cache_files(env) == ["net1/keep1/eth0.json"]


@pytest.mark.parametrize(
    ("version", "extra", "plugins"),
    [("1.0.0", {}, True), ("1.1.0", {"disableGC": True}, True), ("1.1.0", {}, False)],
    ids=["1.0.0", "disabled", "cache-only"],
)
async def test_gc_asks_no_plugin_where_the_config_has_none(
    env: Env, version: str, extra: dict[str, Any], plugins: bool
) -> None:
    env.write(chain(env, version=version) | extra)
    client = env.client()
    await client.add(POD)
    await client.gc([], plugins=plugins)
    assert [cmd for cmd, _ in seen(env)] == ["ADD"] * 3 + ["DEL"] * 3
    assert cache_files(env) == []


async def test_gc_goes_on_past_failures_and_reports_them_all(env: Env) -> None:
    env.write(
        chain(
            env,
            version="1.1.0",
            main={"DEL": {"error": {"code": 5, "msg": "del failed"}}},
            tune={"GC": {"error": {"code": 5, "msg": "gc failed"}}},
        )
    )
    client = env.client()
    await client.add(POD)
    with pytest.raises(GcError) as info:
        await client.gc([])
    assert [f.message for f in info.value.failures] == [
        "CNI plugin main DEL failed (code 5): del failed",
        "CNI plugin tune GC failed (code 5): gc failed",
    ]
    assert [cmd for cmd, _ in seen(env)][-3:] == ["GC"] * 3


async def test_operations_need_a_valid_config(env: Env) -> None:
    with pytest.raises(ConfigError, match=f"^{env.conf_dir}: no network config"):
        await env.client().add(POD)
    await env.client().delete(POD)  # nothing cached, nothing to do


def slow(env: Env, version: str = "1.0.0", **fake: object) -> dict[str, Any]:
    env.plugins("slow")
    return {"cniVersion": version, "name": "net1", "plugins": [env.plugin("slow", **fake)]}


async def test_one_container_at_a_time_different_ones_together(env: Env, tmp_path: Path) -> None:
    env.write(slow(env, ADD={"sleep": 0.3}))
    client = env.client()
    await asyncio.gather(
        client.add(POD), client.add(Attachment("sandbox1", "/proc/self/ns/net", ifname="eth1"))
    )
    first, second = sorted(env.calls(), key=lambda c: c["t0"])
    assert first["t1"] <= second["t0"]

    env.log.unlink()
    # Each plugin waits until both containers' plugins have started: only together do they pass.
    env.write(slow(env, ADD={"meet": [str(tmp_path / "meet"), 2]}))
    await asyncio.gather(
        client.add(Attachment("a", "/proc/self/ns/net")), client.add(Attachment("b", "/proc/self/ns/net"))
    )
    assert len(env.calls()) == 2


async def test_gc_runs_alone(env: Env) -> None:
    env.write(slow(env, "1.1.0", ADD={"sleep": 0.3}, GC={"sleep": 0.3}))
    client = env.client()
    before = asyncio.create_task(client.add(Attachment("a", "/proc/self/ns/net")))
    await asyncio.sleep(0)  # the ADD is under way
    gc = asyncio.create_task(client.gc([("a", "eth0"), ("b", "eth0")]))
    await asyncio.sleep(0)  # the GC waits for it
    after = asyncio.create_task(client.add(Attachment("b", "/proc/self/ns/net")))
    await asyncio.gather(before, gc, after)
    add_a, gc_call, add_b = sorted(env.calls(), key=lambda c: c["t0"])
    assert [add_a["env"]["CNI_COMMAND"], gc_call["env"]["CNI_COMMAND"], add_b["env"]["CNI_COMMAND"]] == [
        "ADD",
        "GC",
        "ADD",
    ]
    assert add_a["t1"] <= gc_call["t0"] and gc_call["t1"] <= add_b["t0"]


async def test_a_gc_given_up_lets_the_operations_it_held_back_go(env: Env, tmp_path: Path) -> None:
    # a's ADD waits until b's has started; b waits behind the GC until the GC is cancelled.
    env.write(slow(env, "1.1.0", ADD={"meet": [str(tmp_path / "meet"), 2]}))
    client = env.client()
    a = asyncio.create_task(client.add(Attachment("a", "/proc/self/ns/net")))
    await asyncio.sleep(0)
    gc = asyncio.create_task(client.gc([]))
    await asyncio.sleep(0)
    b = asyncio.create_task(client.add(Attachment("b", "/proc/self/ns/net")))
    await asyncio.sleep(0.2)
    gc.cancel()
    await asyncio.gather(a, b)
    assert sorted(c["env"]["CNI_CONTAINERID"] for c in env.calls()) == ["a", "b"]
    assert gc.cancelled()
