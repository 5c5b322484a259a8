"""Engine names and labels of cri-shim's objects.

Every engine container cri-shim makes carries its CRI ID and kind in labels,
plus the CRI config it was made from, so that a restarted shim (or an
operator with ``docker ps``) can tell what each one is and remove the ones
no record claims.
"""

from __future__ import annotations

import base64
import re

from cri_api import api_pb2 as pb

PREFIX = "io.cri-shim."
KIND = PREFIX + "kind"  # "sandbox" | "container"
# Which shim made it: recovery only touches its own instance's objects, so
# two shims (or a test run next to a shim) can share one engine.
INSTANCE = PREFIX + "instance"
ID = PREFIX + "id"  # the CRI ID (64 hex)
SANDBOX_ID = PREFIX + "sandbox-id"
HANDLER = PREFIX + "handler"
CREATED = PREFIX + "created-at"  # ns
CONFIG = PREFIX + "config"  # base64 of the serialized CRI config message
LOG_PATH = PREFIX + "log-path"
IMAGE_NAME = PREFIX + "image"

SANDBOX = "sandbox"
CONTAINER = "container"
WARM = "warm"  # a pause container made ahead of its pod (warm.py); ID is "warm-..." until a pod takes it

_UNSAFE = re.compile(r"[^a-zA-Z0-9_.-]+")


def _safe(part: str) -> str:
    return _UNSAFE.sub("-", part)[:40] or "x"


def sandbox_name(sandbox_id: str, config: pb.PodSandboxConfig) -> str:
    md = config.metadata
    return f"crishim_POD_{_safe(md.name)}_{_safe(md.namespace)}_{md.attempt}_{sandbox_id}"


def warm_name(warm_id: str) -> str:
    return f"crishim_WARM_{warm_id}"


def container_name(container_id: str, config: pb.ContainerConfig) -> str:
    md = config.metadata
    return f"crishim_{_safe(md.name)}_{md.attempt}_{container_id}"


def encode_config(msg: pb.PodSandboxConfig | pb.ContainerConfig) -> str:
    return base64.b64encode(msg.SerializeToString(deterministic=True)).decode()


def decode_sandbox_config(value: str) -> pb.PodSandboxConfig:
    cfg = pb.PodSandboxConfig()
    cfg.ParseFromString(base64.b64decode(value))
    return cfg


def ours(instance: str) -> dict[str, list[str]]:
    """An engine list filter for the objects of one shim instance."""
    return {"label": [KIND, f"{INSTANCE}={instance}"]}
