"""[server] cgroup_driver: what RuntimeConfig reports (the v1.34+ kubelet takes its cgroup driver
from it), and "systemd" refused at start on a host that did not boot with systemd."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import grpc
import pytest

from cri_api import api_pb2 as pb
from cri_api import api_pb2_grpc
from shim import server as server_module
from shim.config import Config, HandlerConfig
from shim.server import Server, ServerError
from tests.conftest import make_ids, server_config


def _config(root: str, driver: str, handler_driver: str = "") -> Config:
    cfg = server_config(root, cgroup_driver=driver)
    options = {"state_dir": os.path.join(root, "fake")} | (
        {"cgroup_driver": handler_driver} if handler_driver else {}
    )
    return dataclasses.replace(cfg, handlers={"fake": HandlerConfig("fake", "fake", options)})


@pytest.mark.parametrize(
    ("driver", "handler_driver", "where"),
    [("systemd", "", "[server] cgroup_driver"), ("cgroupfs", "systemd", "[handlers.fake] cgroup_driver")],
    ids=["server", "handler"],
)
async def test_systemd_without_systemd_is_refused_at_start(
    short_tmp: str, monkeypatch: pytest.MonkeyPatch, driver: str, handler_driver: str, where: str
) -> None:
    monkeypatch.setattr(server_module, "SYSTEMD_RUNTIME_DIR", os.path.join(short_tmp, "no-systemd"))
    server = Server(_config(short_tmp, driver, handler_driver), id_factory=make_ids())
    with pytest.raises(ServerError, match="needs systemd as the init system") as info:
        await server.start()
    assert where in str(info.value) and "PID 1 is" in str(info.value)
    assert not os.listdir(short_tmp)  # nothing made: no socket, no state directory


@pytest.mark.parametrize("driver", ["cgroupfs", "systemd"])
async def test_runtime_config_reports_the_configured_driver(
    short_tmp: str, monkeypatch: pytest.MonkeyPatch, driver: str
) -> None:
    booted = Path(short_tmp) / "run-systemd-system"
    booted.mkdir()  # as on a host whose init is systemd
    monkeypatch.setattr(server_module, "SYSTEMD_RUNTIME_DIR", str(booted))
    server = Server(_config(short_tmp, driver), id_factory=make_ids())
    await server.start()
    channel = grpc.aio.insecure_channel(f"unix://{short_tmp}/cri.sock")
    try:
        rc = await api_pb2_grpc.RuntimeServiceStub(channel).RuntimeConfig(pb.RuntimeConfigRequest())
        assert rc.linux.cgroup_driver == (pb.SYSTEMD if driver == "systemd" else pb.CGROUPFS)
    finally:
        await channel.close()
        await server.stop(0)
