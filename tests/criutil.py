"""Builders of CRI requests shared by the tests."""

from __future__ import annotations

import asyncio
import inspect
import itertools
import time
from collections.abc import Callable
from typing import Any

from cri_api import api_pb2 as pb

_uid = itertools.count(1)


def sandbox_config(
    name: str = "pod",
    namespace: str = "default",
    uid: str | None = None,
    attempt: int = 0,
    log_directory: str = "",
    labels: dict[str, str] | None = None,
    annotations: dict[str, str] | None = None,
    **kw: Any,
) -> pb.PodSandboxConfig:
    cfg = pb.PodSandboxConfig(
        metadata=pb.PodSandboxMetadata(
            name=name,
            namespace=namespace,
            uid=uid if uid is not None else f"uid-{next(_uid)}",
            attempt=attempt,
        ),
        log_directory=log_directory,
        hostname=kw.pop("hostname", name),
        **kw,
    )
    cfg.labels.update(labels or {})
    cfg.annotations.update(annotations or {})
    return cfg


def container_config(
    name: str = "ctr",
    image: str = "busybox",
    command: list[str] | None = None,
    log_path: str = "",
    labels: dict[str, str] | None = None,
    annotations: dict[str, str] | None = None,
    attempt: int = 0,
    **kw: Any,
) -> pb.ContainerConfig:
    cfg = pb.ContainerConfig(
        metadata=pb.ContainerMetadata(name=name, attempt=attempt),
        image=pb.ImageSpec(image=image),
        command=command or [],
        log_path=log_path,
        **kw,
    )
    cfg.labels.update(labels or {})
    cfg.annotations.update(annotations or {})
    return cfg


async def until(cond: Callable[[], object], seconds: float = 5.0) -> None:
    """Poll ``cond`` (a function, or a coroutine function) until it holds; fail after ``seconds``."""
    deadline = time.monotonic() + seconds
    while True:
        held = cond()
        if inspect.isawaitable(held):
            held = await held
        if held:
            return
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)
