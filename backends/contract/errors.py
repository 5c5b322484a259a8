"""Conditions raised by backends and the CRI layer; ``shim.cri.errors`` maps each to a gRPC code.

    CriError
    ├── NotFoundError            the object does not exist
    ├── AlreadyExistsError       a name or ID is taken
    ├── InvalidArgumentError     the request cannot be honoured as asked
    ├── FailedPreconditionError  the object is not in a state that allows it
    ├── UnimplementedError       the runtime handler cannot do this at all
    ├── UnavailableError         the runtime (engine, VM, agent) is down or gone
    ├── DeadlineExceededError    it did not finish in time
    ├── ResourceExhaustedError   the node has no room
    └── InternalError            a host tool or the runtime failed in a way that is not the caller's

Anything else that escapes a backend is a bug: the servicer answers UNKNOWN
and logs its traceback, which never reaches the client.
"""

from __future__ import annotations


class CriError(Exception):
    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class NotFoundError(CriError):
    pass


class AlreadyExistsError(CriError):
    pass


class InvalidArgumentError(CriError):
    pass


class FailedPreconditionError(CriError):
    pass


class UnimplementedError(CriError):
    pass


class UnavailableError(CriError):
    pass


class AbortedError(CriError):
    """Refused by a party the runtime consults (an NRI plugin); retrying may succeed."""


class DeadlineExceededError(CriError):
    pass


class ResourceExhaustedError(CriError):
    pass


class InternalError(CriError):
    pass
