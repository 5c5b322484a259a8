"""Conditions raised by the CRI layer and the backends, mapped to gRPC codes once.

    CriError
    ├── NotFoundError            NOT_FOUND
    ├── AlreadyExistsError       ALREADY_EXISTS
    ├── InvalidArgumentError     INVALID_ARGUMENT
    ├── FailedPreconditionError  FAILED_PRECONDITION
    ├── UnimplementedError       UNIMPLEMENTED
    ├── UnavailableError         UNAVAILABLE       (the runtime is down)
    ├── DeadlineExceededError    DEADLINE_EXCEEDED
    ├── ResourceExhaustedError   RESOURCE_EXHAUSTED
    └── InternalError            INTERNAL

Business code raises these; only :mod:`shim.servicer` turns them into a
gRPC status. Anything that is not a CriError is a bug: it becomes UNKNOWN
and is logged with its traceback, which never reaches the client.
"""

from __future__ import annotations

import grpc


class CriError(Exception):
    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class NotFoundError(CriError):
    code = grpc.StatusCode.NOT_FOUND


class AlreadyExistsError(CriError):
    code = grpc.StatusCode.ALREADY_EXISTS


class InvalidArgumentError(CriError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class FailedPreconditionError(CriError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class UnimplementedError(CriError):
    code = grpc.StatusCode.UNIMPLEMENTED


class UnavailableError(CriError):
    code = grpc.StatusCode.UNAVAILABLE


class DeadlineExceededError(CriError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class ResourceExhaustedError(CriError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class InternalError(CriError):
    code = grpc.StatusCode.INTERNAL
