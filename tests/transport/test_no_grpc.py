"""The native transport runs without grpc: importing it costs about 21 MiB of memory (issue 28).

A real server is started in a fresh interpreter (the test process has grpc
loaded already, for its clients), answers a call from a grpc client in this
process, and then says which grpc modules it holds. With ``transport =
"grpcio"`` the same script must see grpc: that proves the check can fail.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import grpc
import pytest

from cri_api import api_pb2 as pb
from cri_api import api_pb2_grpc
from shim.cri.codes import Code

REPO = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent(
    """
    import asyncio, dataclasses, json, os, sys
    import shim.cli, shim.server  # what the cri-shim command imports
    from backends.fake import FakeBackend
    from shim.config import Config
    from shim.server import Server

    async def main(root, transport):
        base = Config()
        cfg = dataclasses.replace(
            base,
            server=dataclasses.replace(
                base.server, listen=f"unix://{root}/cri.sock", state_dir=f"{root}/state", transport=transport
            ),
            nri=dataclasses.replace(base.nri, socket_path=f"{root}/nri.sock"),
        )
        server = Server(cfg, backends={"fake": FakeBackend("fake", {"state_dir": f"{root}/fake"})})
        await server.start()
        print("ready", flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
        loaded = sorted(m for m in sys.modules if m == "grpc" or m.startswith("grpc.") or m.endswith("_pb2_grpc"))
        print("loaded", json.dumps(loaded), flush=True)
        await server.stop(0)

    asyncio.run(main(sys.argv[1], sys.argv[2]))
    """
)


def _serve_and_list_grpc_modules(root: str, transport: str) -> list[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", SCRIPT, root, transport],
        cwd=REPO,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,  # the server logs there too
        text=True,
    )
    try:
        assert proc.stdout is not None
        seen = []
        while (line := proc.stdout.readline()) not in ("ready\n", ""):
            seen.append(line)
        assert line == "ready\n", "".join(seen)
        with grpc.insecure_channel(f"unix://{root}/cri.sock") as channel:
            stub = api_pb2_grpc.RuntimeServiceStub(channel)
            assert stub.Version(pb.VersionRequest(), timeout=30).runtime_api_version == "v1"
            with pytest.raises(grpc.RpcError) as err:
                stub.ContainerStatus(pb.ContainerStatusRequest(container_id="missing"), timeout=30)
            assert err.value.code() == grpc.StatusCode.NOT_FOUND
        out, _ = proc.communicate("done\n", timeout=60)
        assert proc.returncode == 0, out
        results = [line.split(" ", 1)[1] for line in out.splitlines() if line.startswith("loaded ")]
        assert len(results) == 1, out
        loaded: list[str] = json.loads(results[0])
        return loaded
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def test_a_native_server_imports_no_grpc(short_tmp: str) -> None:
    assert _serve_and_list_grpc_modules(short_tmp, "native") == []


def test_the_check_sees_grpc_under_the_grpcio_transport(short_tmp: str) -> None:
    assert "grpc" in _serve_and_list_grpc_modules(short_tmp, "grpcio")


def test_the_codes_are_grpcs_own() -> None:
    """Names and numbers as in gRPC's status code specification: what goes on the wire."""
    assert [(c.name, int(c)) for c in Code] == [(s.name, s.value[0]) for s in grpc.StatusCode]
