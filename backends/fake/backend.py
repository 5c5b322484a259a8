"""The fake runtime: complete CRI behaviour in memory, plus a spy.

Composed of one part per concern:

- :mod:`backends.fake.lifecycle`: sandboxes, containers, running programs, exits, logs;
- :mod:`backends.fake.images`: the image store (persisted in the state directory);
- :mod:`backends.fake.program`: what a container runs, the built-in shell, exec rules;
- :mod:`backends.fake.exec`: ExecSync, exec, attach, port-forward;
- :mod:`backends.fake.stats`: usage figures;
- :mod:`backends.fake.faults`: the spy and injection (``calls``, ``set_latency``,
  ``inject_error``) that ``FakeBackend`` wears around the rest, as any backend can.

- :mod:`backends.fake.checkpoint`: CheckpointContainer, CheckpointPod, RestorePod;

``FakeRuntime`` only names them as the Backend's parts: ``lifecycle`` (which is its
``resources`` too), ``images``, ``exec``, ``stats``, ``checkpoint``; it has no metrics.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from backends.contract import Backend, Capability, Checkpoint, EventSink, ExecResult, Metrics
from backends.contract.pool import PoolFigures
from backends.fake.checkpoint import FakeCheckpoint
from backends.fake.exec import FakeExec
from backends.fake.faults import FaultInjector
from backends.fake.images import FakeImages, PullRecord
from backends.fake.lifecycle import FakeLifecycle
from backends.fake.program import Programs
from backends.fake.stats import FakeStats

CAPABILITIES = Capability.HOST_NETWORK | Capability.MOUNT_OPTIONS


class FakeRuntime:
    """The fake's parts as one Backend, without the spy."""

    def __init__(
        self, name: str, options: Mapping[str, Any], clock: Callable[[], int] = time.time_ns
    ) -> None:
        self.name = name
        self.capabilities = CAPABILITIES
        self.programs = Programs(name, options)
        self.images = FakeImages(options, clock)
        self.lifecycle = FakeLifecycle(options, self.images, self.programs, clock)
        self.images.containers = self.lifecycle.containers  # whose writable layers ImageFsInfo counts
        self.exec = FakeExec(options, self.lifecycle, self.programs)
        self.stats = FakeStats(self.lifecycle, self.images.containers_dir, clock)
        self.resources = self.lifecycle  # it accepts new limits (and enforces none)
        self.metrics: Metrics | None = None
        self.checkpoint: Checkpoint | None = FakeCheckpoint(
            self.lifecycle, self.images, float(options.get("checkpoint_seconds", 0.0))
        )

    def why_not(self, capability: Capability) -> str:
        return ""

    def set_pod_cidr(self, cidr: str) -> None:
        """Pods take addresses from the kubelet's range for this node (a hollow node's too)."""
        self.lifecycle.set_pod_cidr(cidr)

    def warm_figures(self) -> PoolFigures | None:
        return None  # no pool: every sandbox is made for its pod


class FakeBackend(FaultInjector):
    """The fake runtime wearing fault injection: what the ``fake`` handler type creates.

    Options: those of the parts (``state_dir``, ``pull_seconds``, ``checkpoint_seconds``, ``pause_image``,
    ``images``, ``missing_images``, ``programs``, ``exec``, ``port_responses``,
    ``pod_cidr``, ``cgroup_driver``) and of the injector (``latency``, ``errors``,
    ``max_calls``).
    """

    def __init__(
        self, name: str, options: Mapping[str, Any], clock: Callable[[], int] = time.time_ns
    ) -> None:
        self.runtime = FakeRuntime(name, options, clock)
        self.options = dict(options)
        super().__init__(self.runtime, options, clock=clock)

    # The fake's own helpers, for tests.
    @property
    def pulls(self) -> list[PullRecord]:
        """Each image pull with the auth it carried (and the registry hosts it would have asked)."""
        return self.runtime.images.pulls

    @property
    def events(self) -> EventSink | None:
        return self.runtime.lifecycle.events

    @property
    def runtime_ready(self) -> bool:
        return self.runtime.lifecycle.runtime_ready

    @runtime_ready.setter
    def runtime_ready(self, value: bool) -> None:
        self.runtime.lifecycle.runtime_ready = value

    @property
    def network_ready(self) -> bool:
        return self.runtime.lifecycle.network_ready

    @network_ready.setter
    def network_ready(self, value: bool) -> None:
        self.runtime.lifecycle.network_ready = value

    def add_exec_rule(self, cmd: Sequence[str], result: ExecResult, delay: float = 0.0) -> None:
        self.runtime.programs.add_exec_rule(cmd, result, delay)


if TYPE_CHECKING:
    _runtime: type[Backend] = FakeRuntime  # both are Backends (mypy checks it here)
    _backend: type[Backend] = FakeBackend
