"""The one table from a condition to its gRPC status code (shim.cri.errors)."""

from __future__ import annotations

import pytest

from backends.contract import errors
from shim.cri import errors as cri_errors
from shim.cri.codes import Code

CODES = [
    (errors.NotFoundError, Code.NOT_FOUND),
    (errors.AlreadyExistsError, Code.ALREADY_EXISTS),
    (errors.InvalidArgumentError, Code.INVALID_ARGUMENT),
    (errors.FailedPreconditionError, Code.FAILED_PRECONDITION),
    (errors.UnimplementedError, Code.UNIMPLEMENTED),
    (errors.UnavailableError, Code.UNAVAILABLE),
    (errors.AbortedError, Code.ABORTED),
    (errors.DeadlineExceededError, Code.DEADLINE_EXCEEDED),
    (errors.ResourceExhaustedError, Code.RESOURCE_EXHAUSTED),
    (errors.InternalError, Code.INTERNAL),
    (errors.CriError, Code.UNKNOWN),
]


@pytest.mark.parametrize(("cls", "code"), CODES, ids=[cls.__name__ for cls, _ in CODES])
def test_each_condition_has_its_code_and_is_named_from_the_cri_layer(
    cls: type[errors.CriError], code: Code
) -> None:
    assert cri_errors.status_code(cls("x")) is code
    assert getattr(cri_errors, cls.__name__) is cls


def test_a_subclass_takes_the_code_of_its_condition() -> None:
    class BootError(errors.UnavailableError):
        pass

    assert cri_errors.status_code(BootError("no VM")) is Code.UNAVAILABLE


def test_every_condition_is_in_the_table() -> None:
    conditions = {v for v in vars(errors).values() if isinstance(v, type) and issubclass(v, errors.CriError)}
    assert conditions == {cls for cls, _ in CODES}
