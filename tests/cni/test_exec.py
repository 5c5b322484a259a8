"""Running one plugin: lookup on the path, CNI_* environment, stdin, errors, timeout and kill."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest

from backends.cni import PluginError, PluginNotFoundError, PluginTimeoutError
from backends.cni.exec import Invocation, find_plugin, run_plugin
from backends.contract.errors import DeadlineExceededError, FailedPreconditionError, InternalError
from tests.cni import fakeplugin

ADD = Invocation("ADD", "c1", "/run/netns/x", "eth0", "IgnoreUnknown=1;K8S_POD_NAME=web")


def conf(tmp_path: Path, **fake: object) -> dict[str, object]:
    return {"cniVersion": "1.0.0", "name": "net", **fakeplugin.plugin("fake", tmp_path / "log", **fake)}


async def test_the_plugin_gets_the_cni_environment_and_its_config(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fakeplugin.install(tmp_path / "bin", "fake")
    monkeypatch.setenv("CNI_LEFTOVER", "not ours")
    monkeypatch.setenv("KEEP_ME", "inherited")
    c = conf(tmp_path)
    out = await run_plugin("fake", [str(tmp_path / "none"), str(tmp_path / "bin")], ADD, c, 10)
    assert json.loads(out)["interfaces"] == [{"name": "eth0", "sandbox": "/run/netns/x"}]
    (call,) = fakeplugin.calls(tmp_path / "log")
    assert call["env"] == {
        "CNI_COMMAND": "ADD",
        "CNI_CONTAINERID": "c1",
        "CNI_NETNS": "/run/netns/x",
        "CNI_IFNAME": "eth0",
        "CNI_ARGS": "IgnoreUnknown=1;K8S_POD_NAME=web",
        "CNI_PATH": f"{tmp_path / 'none'}:{tmp_path / 'bin'}",
    }
    assert call["stdin"] == c


def test_the_first_directory_that_has_the_plugin_wins(tmp_path: Path) -> None:
    fakeplugin.install(tmp_path / "a", "bridge")
    fakeplugin.install(tmp_path / "b", "bridge", "portmap")
    (tmp_path / "a" / "portmap").write_text("not executable")
    dirs = [str(tmp_path / "a"), str(tmp_path / "b")]
    assert find_plugin("bridge", dirs) == str(tmp_path / "a" / "bridge")
    assert find_plugin("portmap", dirs) == str(tmp_path / "b" / "portmap")
    with pytest.raises(PluginNotFoundError, match=rf"'vlan' not found in {tmp_path}/a:{tmp_path}/b") as info:
        find_plugin("vlan", dirs)
    assert isinstance(info.value, FailedPreconditionError)


async def test_status_and_gc_set_only_the_command_and_path(tmp_path: Path) -> None:
    fakeplugin.install(tmp_path / "bin", "fake")
    await run_plugin("fake", [str(tmp_path / "bin")], Invocation("STATUS"), conf(tmp_path), 10)
    (call,) = fakeplugin.calls(tmp_path / "log")
    assert call["env"] == {"CNI_COMMAND": "STATUS", "CNI_PATH": str(tmp_path / "bin")}


@pytest.mark.parametrize(
    ("fake", "code", "text"),
    [
        (
            {
                "ADD": {
                    "error": {
                        "cniVersion": "1.0.0",
                        "code": 7,
                        "msg": "Invalid Configuration",
                        "details": "/31",
                    }
                }
            },
            7,
            "CNI plugin fake ADD failed (code 7): Invalid Configuration: /31",
        ),
        (
            {"ADD": {"error": {"code": 11, "msg": "try again"}, "stream": "stderr"}},
            11,
            "CNI plugin fake ADD failed (code 11): try again",
        ),
        (
            {"ADD": {"exit": 2, "stderr": "panic: boom\n"}},
            0,
            "CNI plugin fake ADD failed (code 0): exit status 2: panic: boom",
        ),
    ],
    ids=["json-error-on-stdout", "json-error-on-stderr", "no-json"],
)
async def test_a_failure_names_plugin_code_and_message(
    tmp_path: Path, fake: dict[str, object], code: int, text: str
) -> None:
    fakeplugin.install(tmp_path / "bin", "fake")
    with pytest.raises(PluginError) as info:
        await run_plugin("fake", [str(tmp_path / "bin")], ADD, conf(tmp_path, **fake), 10)
    assert isinstance(info.value, InternalError)
    assert (info.value.plugin, info.value.command, info.value.code) == ("fake", "ADD", code)
    assert info.value.message == text


async def test_a_hanging_plugin_is_killed_with_what_it_started(tmp_path: Path) -> None:
    fakeplugin.install(tmp_path / "bin", "fake")
    pids = tmp_path / "pids"
    start = time.monotonic()
    with pytest.raises(
        PluginTimeoutError, match=r"CNI plugin fake ADD did not finish in 1.5s; killed"
    ) as info:
        await run_plugin("fake", [str(tmp_path / "bin")], ADD, conf(tmp_path, ADD={"hang": str(pids)}), 1.5)
    assert 1.5 <= time.monotonic() - start < 10
    assert isinstance(info.value, DeadlineExceededError)
    plugin_pid, child_pid = map(int, pids.read_text().split())
    assert not fakeplugin.alive(plugin_pid)
    for _ in range(100):  # the orphaned child is reaped by whoever adopted it
        if not fakeplugin.alive(child_pid):
            break
        await asyncio.sleep(0.05)
    assert not fakeplugin.alive(child_pid)


async def test_a_cancelled_call_kills_the_plugin(tmp_path: Path) -> None:
    fakeplugin.install(tmp_path / "bin", "fake")
    pids = tmp_path / "pids"
    task = asyncio.create_task(
        run_plugin("fake", [str(tmp_path / "bin")], ADD, conf(tmp_path, ADD={"hang": str(pids)}), 60)
    )
    for _ in range(400):
        if pids.exists() and pids.read_text():
            break
        await asyncio.sleep(0.025)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    plugin_pid, _ = map(int, pids.read_text().split())
    assert not fakeplugin.alive(plugin_pid)
