"""What the CRI layer (``shim``) and the backends share, knowing neither of them.

- :mod:`~backends.contract.errors`: the conditions a backend raises, with no
  gRPC in them (``shim.cri.errors`` maps each to a status code, once);
- :mod:`~backends.contract.records`: the shim's records of pods and containers;
- :mod:`~backends.contract.values`: what backends report (exits, networks,
  recovery observations, exec results);
- :mod:`~backends.contract.usage`: usage samples (stats and metrics figures);
- :mod:`~backends.contract.process`: a started container's output and exit,
  which the shim follows (log, exit reported once after the drain);
- :mod:`~backends.contract.protocols`: ``Backend`` and its parts (lifecycle,
  always; images, exec and streams, stats, metrics, resources, checkpoints,
  each present or None), and the ``Capability`` flags;
- :mod:`~backends.contract.proxy`: a backend seen through a wrapper of its
  parts' calls (the fault injector's, the shim's metrics').

The names below are loaded on first use, so that a light importer (the
runv guest agent reads only :mod:`~backends.contract.usage`) does not load
the CRI protobufs the protocols need. The conditions are not among them:
modules import them from :mod:`~backends.contract.errors`, or that module.

Imports run one way: ``cri_api`` <- this package <- the backends; ``shim``
uses this package and the registry; nothing here imports ``shim`` or gRPC
(tests/rules/test_import_contract.py).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from backends.contract.process import (
        ContainerProcess,
        ExitLatch,
        LogMarks,
        Output,
        ProcessPipe,
        Started,
    )
    from backends.contract.protocols import (
        MOUNT_OPTIONS,
        Backend,
        Capability,
        Checkpoint,
        EventSink,
        Exec,
        Images,
        Lifecycle,
        Metrics,
        PortStream,
        Resources,
        Stats,
        StreamIO,
    )
    from backends.contract.records import (
        ContainerRecord,
        ContainerStatus,
        EffectiveUser,
        SandboxRecord,
        SandboxStatus,
    )
    from backends.contract.usage import ContainerUsage, PodMetrics, SandboxUsage
    from backends.contract.values import (
        ContainerCheckpoint,
        ExecResult,
        ExitInfo,
        Health,
        ImageInfo,
        Observed,
        PodCheckpoint,
        SandboxNetwork,
        Seccomp,
        TerminalSize,
        cri_signal,
        decide_stop_signal,
        host_signal,
        image_user,
        recorded_stop_signal,
        seccomp_of,
        signal_by_name,
        signal_name,
    )

_WHERE = {
    "Backend": "protocols",
    "Capability": "protocols",
    "Checkpoint": "protocols",
    "ContainerCheckpoint": "values",
    "ContainerProcess": "process",
    "ContainerRecord": "records",
    "ContainerStatus": "records",
    "ContainerUsage": "usage",
    "EffectiveUser": "records",
    "EventSink": "protocols",
    "Exec": "protocols",
    "ExecResult": "values",
    "ExitInfo": "values",
    "ExitLatch": "process",
    "Health": "values",
    "ImageInfo": "values",
    "Images": "protocols",
    "Lifecycle": "protocols",
    "MOUNT_OPTIONS": "protocols",
    "LogMarks": "process",
    "Metrics": "protocols",
    "Observed": "values",
    "PodCheckpoint": "values",
    "Output": "process",
    "PodMetrics": "usage",
    "PortStream": "protocols",
    "ProcessPipe": "process",
    "Resources": "protocols",
    "SandboxNetwork": "values",
    "SandboxRecord": "records",
    "SandboxStatus": "records",
    "SandboxUsage": "usage",
    "Seccomp": "values",
    "Started": "process",
    "Stats": "protocols",
    "StreamIO": "protocols",
    "TerminalSize": "values",
    "cri_signal": "values",
    "decide_stop_signal": "values",
    "host_signal": "values",
    "image_user": "values",
    "recorded_stop_signal": "values",
    "seccomp_of": "values",
    "signal_by_name": "values",
    "signal_name": "values",
}


def __getattr__(name: str) -> object:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'backends.contract' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"backends.contract.{module}"), name)
    globals()[name] = value
    return value


__all__ = [
    "MOUNT_OPTIONS",
    "Backend",
    "Capability",
    "Checkpoint",
    "ContainerCheckpoint",
    "ContainerProcess",
    "ContainerRecord",
    "ContainerStatus",
    "ContainerUsage",
    "EffectiveUser",
    "EventSink",
    "Exec",
    "ExecResult",
    "ExitInfo",
    "ExitLatch",
    "Health",
    "ImageInfo",
    "Images",
    "Lifecycle",
    "LogMarks",
    "Metrics",
    "Observed",
    "Output",
    "PodCheckpoint",
    "PodMetrics",
    "PortStream",
    "ProcessPipe",
    "Resources",
    "SandboxNetwork",
    "SandboxRecord",
    "SandboxStatus",
    "SandboxUsage",
    "Seccomp",
    "Started",
    "Stats",
    "StreamIO",
    "TerminalSize",
    "cri_signal",
    "decide_stop_signal",
    "host_signal",
    "image_user",
    "recorded_stop_signal",
    "seccomp_of",
    "signal_by_name",
    "signal_name",
]
