"""Version, Status, RuntimeConfig, UpdateRuntimeConfig."""

from __future__ import annotations

import asyncio
import ipaddress
import json

from backends.contract import Capability
from cri_api import api_pb2 as pb
from shim import __version__
from shim.cri.errors import InvalidArgumentError
from shim.cri.state import Shim

RUNTIME_NAME = "cri-shim"
RUNTIME_API_VERSION = "v1"
# The version the kubelet's old probe expects in VersionResponse.version.
KUBELET_API_VERSION = "0.1.0"


class RuntimeService:
    def __init__(self, shim: Shim) -> None:
        self.shim = shim

    def version(self, req: pb.VersionRequest) -> pb.VersionResponse:
        return pb.VersionResponse(
            version=KUBELET_API_VERSION,
            runtime_name=RUNTIME_NAME,
            runtime_version=__version__,
            runtime_api_version=RUNTIME_API_VERSION,
        )

    async def status(self, req: pb.StatusRequest) -> pb.StatusResponse:
        shim = self.shim
        names = shim.registry.names()
        healths = await asyncio.gather(*(shim.registry.get(n).lifecycle.health() for n in names))
        by_name = dict(zip(names, healths, strict=True))
        default = by_name[shim.registry.default]
        resp = pb.StatusResponse()
        resp.status.conditions.add(
            type="RuntimeReady",
            status=default.runtime_ready,
            reason="" if default.runtime_ready else (default.reason or "RuntimeNotReady"),
            message="" if default.runtime_ready else default.message,
        )
        resp.status.conditions.add(
            type="NetworkReady",
            status=default.network_ready,
            reason="" if default.network_ready else (default.reason or "NetworkNotReady"),
            message="" if default.network_ready else default.message,
        )
        # Runtime-wide: true only if every handler honours it (the kubelet and critest ask once).
        resp.features.supplemental_groups_policy = all(
            shim.registry.get(n).capabilities & Capability.SUPPLEMENTAL_GROUPS_POLICY for n in names
        )
        resp.features.mount_options = all(
            shim.registry.get(n).capabilities & Capability.MOUNT_OPTIONS for n in names
        )
        # The default handler is listed under "" too, as the kubelet looks it up by that name.
        for name in ["", *names]:
            backend = shim.registry.get(name)
            h = resp.runtime_handlers.add(name=name)
            h.features.recursive_read_only_mounts = bool(
                backend.capabilities & Capability.RECURSIVE_READ_ONLY_MOUNTS
            )
            h.features.user_namespaces = bool(backend.capabilities & Capability.USER_NAMESPACES)
        if req.verbose:
            info = {
                "defaultHandler": shim.registry.default,
                "handlers": {
                    n: {
                        "type": type(shim.registry.get(n)).__name__,
                        "runtimeReady": h.runtime_ready,
                        "networkReady": h.network_ready,
                        "reason": h.reason,
                        "message": h.message,
                        # Mount.mount_options (RuntimeFeatures.mount_options: all handlers apply them).
                        "mountOptions": bool(shim.registry.get(n).capabilities & Capability.MOUNT_OPTIONS),
                    }
                    for n, h in by_name.items()
                },
                "podCIDR": shim.pod_cidr,
                "streaming": shim.streaming is not None,
            }
            resp.info["config"] = json.dumps(info)
        return resp

    async def runtime_config(self, req: pb.RuntimeConfigRequest) -> pb.RuntimeConfigResponse:
        return self.shim.registry.get("").lifecycle.runtime_config()

    async def update_runtime_config(
        self, req: pb.UpdateRuntimeConfigRequest
    ) -> pb.UpdateRuntimeConfigResponse:
        cidr = req.runtime_config.network_config.pod_cidr
        if not cidr or cidr == self.shim.pod_cidr:
            return pb.UpdateRuntimeConfigResponse()
        # A dual-stack node's CIDRs come comma-separated, as the kubelet joins them.
        for part in cidr.split(","):
            try:
                ipaddress.ip_network(part.strip(), strict=False)
            except ValueError:
                raise InvalidArgumentError(f"pod_cidr {cidr!r} is not a CIDR") from None
        self.shim.pod_cidr = cidr
        if self.shim.store.state is not None:
            self.shim.store.state.save_runtime({"pod_cidr": cidr})
        self.shim.hand_pod_cidr()
        return pb.UpdateRuntimeConfigResponse()
