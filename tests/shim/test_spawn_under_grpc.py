"""Child processes spawned while gRPC is serving start cleanly.

Under uvloop a subprocess is started with fork(), which runs gRPC's fork
handlers when its fork support is on; some children then died of SIGSEGV
before exec, with no output (runv's "share attach failed: " with nothing
after the colon, and half the server log was gRPC's "skipping fork()
handlers" line). Importing ``shim`` turns gRPC's fork support off.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent(
    """
    import shim  # first, as the cri-shim command does
    import asyncio, collections, sys, tempfile, os
    import grpc, uvloop
    from cri_api import api_pb2 as pb, api_pb2_grpc as pbg

    class Runtime(pbg.RuntimeServiceServicer):
        async def Version(self, request, context):
            return pb.VersionResponse(version="x")

    async def main():
        sock = os.path.join(tempfile.mkdtemp(dir="/tmp"), "s.sock")
        server = grpc.aio.server()
        pbg.add_RuntimeServiceServicer_to_server(Runtime(), server)
        server.add_insecure_port("unix://" + sock)
        await server.start()
        stub = pbg.RuntimeServiceStub(grpc.aio.insecure_channel("unix://" + sock))
        busy = True

        async def poll():
            while busy:
                await stub.Version(pb.VersionRequest())

        pollers = [asyncio.create_task(poll()) for _ in range(8)]
        seen = collections.Counter()

        async def spawn():
            proc = await asyncio.create_subprocess_exec(
                "sh", "-c", "echo out; exit 3",
                stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
            )
            out, _ = await proc.communicate()
            seen[(proc.returncode, out.decode())] += 1

        for _ in range(60):
            await asyncio.gather(*(spawn() for _ in range(8)))
        busy = False
        await asyncio.gather(*pollers, return_exceptions=True)
        await server.stop(0)
        print(dict(seen))
        sys.exit(0 if set(seen) == {(3, "out\\n")} else 1)

    uvloop.run(main())
    """
)


def test_children_spawned_during_rpcs_run_and_grpc_logs_nothing() -> None:
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=90, cwd=REPO
    )
    assert done.returncode == 0, f"children that did not run: {done.stdout.strip()}"
    assert "fork" not in done.stderr, done.stderr[-2000:]
