"""The one table from a condition (``backends.contract.errors``) to its gRPC status code.

Only :mod:`shim.cri.servicer` asks it. The classes are re-exported so that the
CRI layer names them from one place.
"""

from __future__ import annotations

import grpc

from backends.contract.errors import (
    AbortedError,
    AlreadyExistsError,
    CriError,
    DeadlineExceededError,
    FailedPreconditionError,
    InternalError,
    InvalidArgumentError,
    NotFoundError,
    ResourceExhaustedError,
    UnavailableError,
    UnimplementedError,
)

__all__ = [
    "AbortedError",
    "AlreadyExistsError",
    "CriError",
    "DeadlineExceededError",
    "FailedPreconditionError",
    "InternalError",
    "InvalidArgumentError",
    "NotFoundError",
    "ResourceExhaustedError",
    "UnavailableError",
    "UnimplementedError",
    "status_code",
]

_CODES: dict[type[CriError], grpc.StatusCode] = {
    NotFoundError: grpc.StatusCode.NOT_FOUND,
    AlreadyExistsError: grpc.StatusCode.ALREADY_EXISTS,
    InvalidArgumentError: grpc.StatusCode.INVALID_ARGUMENT,
    FailedPreconditionError: grpc.StatusCode.FAILED_PRECONDITION,
    UnimplementedError: grpc.StatusCode.UNIMPLEMENTED,
    UnavailableError: grpc.StatusCode.UNAVAILABLE,
    DeadlineExceededError: grpc.StatusCode.DEADLINE_EXCEEDED,
    ResourceExhaustedError: grpc.StatusCode.RESOURCE_EXHAUSTED,
    InternalError: grpc.StatusCode.INTERNAL,
    AbortedError: grpc.StatusCode.ABORTED,
}


def status_code(exc: CriError) -> grpc.StatusCode:
    """The code of a condition: that of its nearest class in the table (subclasses of a
    condition, such as runv's BootError, inherit its code); UNKNOWN for a bare CriError."""
    for cls in type(exc).__mro__:
        code = _CODES.get(cls)
        if code is not None:
            return code
    return grpc.StatusCode.UNKNOWN
