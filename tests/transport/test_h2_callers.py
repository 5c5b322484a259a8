"""bench/h2_callers.py, the cheap callers of polled_bench's throughput phases, against both transports.

grpcio's server indexes its answers' headers in its HPACK table, ours does not:
the callers must read both, and count a call as done only on grpc-status 0.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
from types import ModuleType

import pytest

from cri_api import api_pb2 as pb
from tests.transport.conftest import start_native

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RUNTIME = "/runtime.v1.RuntimeService/"


@pytest.fixture(scope="module")
def h2c() -> ModuleType:
    spec = importlib.util.spec_from_file_location("h2_callers", os.path.join(ROOT, "bench", "h2_callers.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("transport", ["native", "grpcio"])
async def test_callers_count_answers_and_failures(h2c: ModuleType, short_tmp: str, transport: str) -> None:
    n = await start_native(short_tmp, transport=transport)
    try:
        version = pb.VersionRequest().SerializeToString()
        rate, errors, done = await asyncio.to_thread(
            h2c.throughput, n.sock, f"{RUNTIME}Version", [version], 2, 4, 0.5
        )
        assert errors == 0 and done > 8 and rate > 0

        # Every call fails: a container nobody made (NOT_FOUND), a method nobody serves.
        missing = pb.ContainerStatusRequest(container_id="f" * 64).SerializeToString()
        _, errors, done = await asyncio.to_thread(
            h2c.throughput, n.sock, f"{RUNTIME}ContainerStatus", [missing], 1, 4, 0.3
        )
        assert done == 0 and errors > 0
        _, errors, done = await asyncio.to_thread(
            h2c.throughput, n.sock, f"{RUNTIME}Nothing", [b""], 1, 2, 0.3
        )
        assert done == 0 and errors > 0
    finally:
        await n.channel.close()
        await n.server.stop(0)


async def test_callers_keep_to_small_windows(h2c: ModuleType, short_tmp: str) -> None:
    """Answers larger than the connection's first 64 KiB: our windows are given back, calls go on."""
    n = await start_native(short_tmp)
    try:
        for i in range(40):
            await n.rt.RunPodSandbox(
                pb.RunPodSandboxRequest(
                    config=pb.PodSandboxConfig(
                        metadata=pb.PodSandboxMetadata(name=f"p{i}", namespace="ns", uid=f"u{i}"),
                        labels={"k": "v" * 200},
                    )
                )
            )
        req = pb.ListPodSandboxRequest().SerializeToString()
        _, errors, done = await asyncio.to_thread(
            h2c.throughput, n.sock, f"{RUNTIME}ListPodSandbox", [req], 1, 8, 1.0
        )
        assert errors == 0 and done > 8 * 2
    finally:
        await n.channel.close()
        await n.server.stop(0)
