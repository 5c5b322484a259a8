"""The one table from a condition (``backends.contract.errors``) to its gRPC status code.

Only :mod:`shim.cri.servicer` asks it. The conditions are re-exported whole, so that the
CRI layer names them from one place and their list is written once, in the contract.
"""

from __future__ import annotations

import grpc

from backends.contract import errors
from backends.contract.errors import *  # noqa: F403  (the re-export)

_CODES: dict[type[errors.CriError], grpc.StatusCode] = {
    errors.NotFoundError: grpc.StatusCode.NOT_FOUND,
    errors.AlreadyExistsError: grpc.StatusCode.ALREADY_EXISTS,
    errors.InvalidArgumentError: grpc.StatusCode.INVALID_ARGUMENT,
    errors.FailedPreconditionError: grpc.StatusCode.FAILED_PRECONDITION,
    errors.UnimplementedError: grpc.StatusCode.UNIMPLEMENTED,
    errors.UnavailableError: grpc.StatusCode.UNAVAILABLE,
    errors.DeadlineExceededError: grpc.StatusCode.DEADLINE_EXCEEDED,
    errors.ResourceExhaustedError: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.InternalError: grpc.StatusCode.INTERNAL,
    errors.AbortedError: grpc.StatusCode.ABORTED,
}


def status_code(exc: errors.CriError) -> grpc.StatusCode:
    """The code of a condition: that of its nearest class in the table (subclasses of a
    condition, such as runv's BootError, inherit its code); UNKNOWN for a bare CriError."""
    for cls in type(exc).__mro__:
        code = _CODES.get(cls)
        if code is not None:
            return code
    return grpc.StatusCode.UNKNOWN
