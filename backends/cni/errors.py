"""What the CNI client raises: the contract's conditions, with the CNI facts in them.

FailedPreconditionError
├── ConfigError            the network config (or its template, or a cache entry) is unusable
└── PluginNotFoundError    a plugin named by the config is on none of the plugin directories
InternalError
├── PluginError            a plugin failed: its name, command, CNI error code and message
├── ResultError            a plugin answered success with a result that cannot be read
└── GcError                some of a GC's DELs or plugin GCs failed (all are listed)
DeadlineExceededError
└── PluginTimeoutError     a plugin did not finish in time and was killed
"""

from __future__ import annotations

from collections.abc import Sequence

from backends.contract.errors import CriError, DeadlineExceededError, FailedPreconditionError, InternalError

# The well-known CNI error code (SPEC.md, "Error") that tells the runtime there is nothing to
# clean up: a DEL takes it as done.
CODE_UNKNOWN_CONTAINER = 3


class ConfigError(FailedPreconditionError):
    def __init__(self, source: str, field: str, problem: str) -> None:
        where = f"{source}: {field}" if field else source
        super().__init__(f"{where}: {problem}")
        self.source = source
        self.field = field
        self.problem = problem


class PluginNotFoundError(FailedPreconditionError):
    def __init__(self, plugin: str, dirs: Sequence[str]) -> None:
        super().__init__(f"CNI plugin {plugin!r} not found in {':'.join(dirs)}")
        self.plugin = plugin
        self.dirs = tuple(dirs)


class PluginError(InternalError):
    """``code`` is the plugin's CNI error code, 0 when it printed no error object."""

    def __init__(self, plugin: str, command: str, code: int, msg: str, details: str = "") -> None:
        text = f"CNI plugin {plugin} {command} failed (code {code}): {msg}"
        super().__init__(f"{text}: {details}" if details else text)
        self.plugin = plugin
        self.command = command
        self.code = code
        self.msg = msg
        self.details = details


class ResultError(InternalError):
    def __init__(self, plugin: str, problem: str) -> None:
        super().__init__(f"CNI plugin {plugin} returned an unreadable result: {problem}")
        self.plugin = plugin


class PluginTimeoutError(DeadlineExceededError):
    def __init__(self, plugin: str, command: str, seconds: float) -> None:
        super().__init__(f"CNI plugin {plugin} {command} did not finish in {seconds:g}s; killed")
        self.plugin = plugin
        self.command = command


class GcError(InternalError):
    def __init__(self, failures: Sequence[CriError]) -> None:
        super().__init__("CNI GC: " + "; ".join(f.message for f in failures))
        self.failures = tuple(failures)
