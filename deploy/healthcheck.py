"""Container health probe: the shim's gRPC health service answers SERVING.

Usage: python healthcheck.py [TARGET [SERVICE]]
TARGET defaults to $CRI_SHIM_HEALTH_TARGET, else the default CRI socket;
SERVICE "" is the whole server (runtime.v1.RuntimeService and
runtime.v1.ImageService are also registered). Exit 0 when serving, 1 otherwise,
as Docker's HEALTHCHECK and a kubelet exec probe expect.
"""

from __future__ import annotations

import os
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

DEFAULT_TARGET = "unix:///run/cri-shim/cri-shim.sock"
TIMEOUT = 5.0


def check(target: str, service: str = "", timeout: float = TIMEOUT) -> tuple[bool, str]:
    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            resp = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError as exc:
            return False, f"{exc.code().name}: {exc.details()}"
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
    return resp.status == health_pb2.HealthCheckResponse.SERVING, status


def main(argv: list[str]) -> int:
    target = argv[1] if len(argv) > 1 else os.environ.get("CRI_SHIM_HEALTH_TARGET", DEFAULT_TARGET)
    service = argv[2] if len(argv) > 2 else ""
    ok, status = check(target, service)
    print(f"{target} {service or '(server)'}: {status}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
