"""Fault injection that any backend can wear: a spy, delays and failures in front of it.

``FaultInjector(inner)`` is a backend with the parts ``inner`` has (an absent part stays
absent, so the shim sees what the inner backend can do), each seen through the injector
(:mod:`backends.contract.proxy`). Every call of a part's coroutine method then, in order:

1. is recorded in ``calls`` (a bounded deque of :class:`Call`), by the method's name;
2. waits the latency set for its method, if any;
3. raises the next error queued for its method, if any (a FIFO per method,
   so a test can say "fail twice, then succeed"), without reaching the inner
   backend;
4. otherwise goes to the inner backend.

The plain methods are facts, not calls to fail (``runtime_config``, ``why_not``,
``warm_figures``), except ``set_pod_cidr``, which is recorded; the images' answers from
memory (``list_images_now``, ``image_fs_info_now``) are recorded as their calls, and give
way to the coroutine while a latency or an error is set for it.

Configured from Python (``set_latency``, ``inject_error``) or from a
handler's options (``latency = {run_sandbox = 0.05}``,
``errors = {start_container = ["UNAVAILABLE: boom"]}``, ``max_calls``).

Arguments are recorded compactly: records by ID, image specs by name,
batches by their size; streams, sinks and auth are left out. A call log
must not keep thousands of removed pods alive.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import inspect
import time
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from backends.contract import Backend, errors
from backends.contract.proxy import BackendProxy

_CODES: dict[str, type[errors.CriError]] = {
    "NOT_FOUND": errors.NotFoundError,
    "ALREADY_EXISTS": errors.AlreadyExistsError,
    "INVALID_ARGUMENT": errors.InvalidArgumentError,
    "FAILED_PRECONDITION": errors.FailedPreconditionError,
    "UNIMPLEMENTED": errors.UnimplementedError,
    "UNAVAILABLE": errors.UnavailableError,
    "DEADLINE_EXCEEDED": errors.DeadlineExceededError,
    "RESOURCE_EXHAUSTED": errors.ResourceExhaustedError,
    "INTERNAL": errors.InternalError,
}


def error_from_spec(spec: str) -> errors.CriError:
    """ "CODE: message" → the condition exception (for the config file)."""
    code, _, message = spec.partition(":")
    cls = _CODES.get(code.strip().upper())
    if cls is None:
        raise ValueError(f"unknown error code {code!r} (known: {', '.join(_CODES)})")
    return cls(message.strip() or f"injected {code.strip()}")


@dataclasses.dataclass(frozen=True, slots=True)
class Call:
    method: str
    args: tuple[Any, ...]
    at: int


_T = TypeVar("_T")

# What is recorded of a call's arguments, by method; any other records its arguments' IDs.
_ARGS: dict[str, Callable[..., tuple[Any, ...]]] = {
    "start": lambda events: (),
    "recover": lambda sandboxes, containers: (len(sandboxes), len(containers)),
    "create_container": lambda container, sandbox: (container.id, sandbox.id),
    "start_container": lambda container, sandbox: (container.id,),
    "reattach": lambda container, after: (container.id,),
    "stop_container": lambda container, timeout: (container.id, timeout),
    "pull_image": lambda image, auth, sandbox_config: (image.image,),
    "image_status": lambda image: (image.image,),
    "remove_image": lambda image: (image.image,),
    "exec_sync": lambda container, cmd: (container.id, tuple(cmd)),
    "exec": lambda container, cmd, io: (container.id, tuple(cmd)),
    "attach": lambda container, io: (container.id,),
    "port_forward": lambda sandbox, port, stream: (sandbox.id, port),
    "container_stats": lambda containers: (len(containers),),
    "sandbox_stats": lambda sandboxes, containers: (len(sandboxes),),
    "sandbox_metrics": lambda sandboxes, containers: (len(sandboxes),),
    "update_container_resources": lambda container, resources: (container.id, resources),
    "update_sandbox_resources": lambda sandbox, request: (sandbox.id,),
    "checkpoint_container": lambda container, location, timeout: (container.id, location, timeout),
    "checkpoint_pod": lambda sandbox, containers, output_dir, options: (
        sandbox.id,
        tuple(c.id for c in containers),
        output_dir,
    ),
    "open_pod_checkpoint": lambda path, options, configs: (path, tuple(c.metadata.name for c in configs)),
    "restore_container": lambda container, sandbox, checkpoint: (container.id, sandbox.id),
    "open_container_checkpoint": lambda source: (source,),
}
# The images' answers from memory, and the call each is recorded as.
_NOW = {"list_images_now": "list_images", "image_fs_info_now": "image_fs_info"}


def _ids(*records: Any, **named: Any) -> tuple[Any, ...]:
    return tuple(r.id for r in (*records, *named.values()))


class FaultInjector(BackendProxy):
    """A Backend in front of ``inner``: records calls, delays them, fails them on demand."""

    def __init__(
        self,
        inner: Backend,
        options: Mapping[str, Any] | None = None,
        *,
        clock: Callable[[], int] = time.time_ns,
    ) -> None:
        options = options or {}
        self.clock = clock
        self.calls: collections.deque[Call] = collections.deque(maxlen=int(options.get("max_calls", 10000)))
        self._latency: dict[str, float] = {}
        self._errors: collections.defaultdict[str, collections.deque[BaseException]] = (
            collections.defaultdict(collections.deque)
        )
        self.configure(options)
        super().__init__(inner, self._around)

    def set_latency(self, method: str, seconds: float) -> None:
        self._latency[method] = seconds

    def inject_error(self, method: str, error: BaseException) -> None:
        self._errors[method].append(error)

    def calls_to(self, method: str) -> list[Call]:
        return [c for c in self.calls if c.method == method]

    def configure(self, options: Mapping[str, Any]) -> None:
        """Apply ``latency`` and ``errors`` from a handler's options."""
        for method, seconds in dict(options.get("latency", {})).items():
            self.set_latency(method, float(seconds))
        for method, specs in dict(options.get("errors", {})).items():
            for spec in specs:
                self.inject_error(method, error_from_spec(str(spec)))

    def set_pod_cidr(self, cidr: str) -> None:
        self.calls.append(Call("set_pod_cidr", (cidr,), self.clock()))  # recorded; nothing to delay
        self.wrapped.set_pod_cidr(cidr)

    def _around(self, method: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        """What a part's method becomes in front of the inner backend's."""
        recorded_as = _NOW.get(method)
        if recorded_as is not None:
            return lambda: self._now(recorded_as, fn)
        if not inspect.iscoroutinefunction(fn):
            return fn  # a fact (runtime_config), not a call to fail
        args_of = _ARGS.get(method, _ids)

        async def call(*args: Any, **kwargs: Any) -> Any:
            await self._enter(method, *args_of(*args, **kwargs))
            return await fn(*args, **kwargs)

        call.__name__ = method
        return call

    def _injected(self, method: str) -> bool:
        """Whether a latency or an error waits for ``method``: then only its coroutine may answer."""
        return bool(self._latency.get(method) or self._errors.get(method))

    def _now(self, method: str, answer: Callable[[], _T | None]) -> _T | None:
        """The inner store's answer from memory, recorded as the call; None (the coroutine, which
        delays or fails it) while a latency or an error is set for the call."""
        if self._injected(method):
            return None
        got = answer()
        if got is not None:  # (None: the inner store cannot say now; its coroutine is recorded)
            self.calls.append(Call(method, (), self.clock()))
        return got

    async def _enter(self, method: str, *args: Any) -> None:
        self.calls.append(Call(method, args, self.clock()))
        delay = self._latency.get(method)
        if delay:
            await asyncio.sleep(delay)
        queue = self._errors.get(method)
        if queue:
            raise queue.popleft()
