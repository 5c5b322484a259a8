"""The one table from a condition (``backends.contract.errors``) to its gRPC status code (:class:`Code`).

Only :mod:`shim.cri.servicer` asks it. The conditions are re-exported whole, so that the
CRI layer names them from one place and their list is written once, in the contract.
"""

from __future__ import annotations

from backends.contract import errors
from backends.contract.errors import *  # noqa: F403  (the re-export)
from shim.cri.codes import Code

_CODES: dict[type[errors.CriError], Code] = {
    errors.NotFoundError: Code.NOT_FOUND,
    errors.AlreadyExistsError: Code.ALREADY_EXISTS,
    errors.InvalidArgumentError: Code.INVALID_ARGUMENT,
    errors.FailedPreconditionError: Code.FAILED_PRECONDITION,
    errors.UnimplementedError: Code.UNIMPLEMENTED,
    errors.UnavailableError: Code.UNAVAILABLE,
    errors.DeadlineExceededError: Code.DEADLINE_EXCEEDED,
    errors.ResourceExhaustedError: Code.RESOURCE_EXHAUSTED,
    errors.InternalError: Code.INTERNAL,
    errors.AbortedError: Code.ABORTED,
}


def status_code(exc: errors.CriError) -> Code:
    """The code of a condition: that of its nearest class in the table (subclasses of a
    condition, such as runv's BootError, inherit its code); UNKNOWN for a bare CriError."""
    for cls in type(exc).__mro__:
        code = _CODES.get(cls)
        if code is not None:
            return code
    return Code.UNKNOWN
