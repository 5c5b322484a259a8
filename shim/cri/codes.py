"""gRPC's status codes, as the CRI layer and the native transport name them.

Our own enum rather than ``grpc.StatusCode``: importing grpc costs about 21 MiB
of resident memory, and only the grpcio transport needs the library (it turns
a :class:`Code` into grpc's own at its edge). The names and numbers are those
of gRPC's status code specification (doc/statuscodes.md), which are what goes
on the wire in ``grpc-status``.
"""

from __future__ import annotations

from enum import IntEnum


class Code(IntEnum):
    OK = 0
    CANCELLED = 1
    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    ALREADY_EXISTS = 6
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    ABORTED = 10
    OUT_OF_RANGE = 11
    UNIMPLEMENTED = 12
    INTERNAL = 13
    UNAVAILABLE = 14
    DATA_LOSS = 15
    UNAUTHENTICATED = 16
