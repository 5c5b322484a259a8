"""One rule for every backend's handler options: an unknown key or a value of the wrong kind is an error
naming the section and the key (backends/contract/options.py), raised when the backend is created."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from backends.contract import options
from backends.contract.errors import InvalidArgumentError
from backends.contract.options import Kind
from backends.registry import create_backend

CASES = [
    ("fake", {"pod_cidrs": "10.1.0.0/16"}, r"\[handlers.h\] unknown key 'pod_cidrs' \(known: .*pod_cidr.*\)"),
    ("fake", {"max_calls": "10"}, r"\[handlers.h\] max_calls: expected a non-negative integer, got '10'"),
    ("fake", {"images": ["busybox"]}, r"\[handlers.h\] images: expected a table"),
    ("docker", {"endpiont": "unix:///x"}, r"\[handlers.h\] unknown key 'endpiont'"),
    ("docker", {"pool": {"sise": 2}}, r"\[handlers.h.pool\] unknown key 'sise' \(known: max_cpu, "),
    ("docker", {"runtime": {"h": 1}}, r"\[handlers.h\] runtime: expected a table of strings"),
    (
        "docker",
        {"call_timeout": True},
        r"\[handlers.h\] call_timeout: expected a non-negative number, got True",
    ),
    ("runv", {"drivr": "qemu"}, r"\[handlers.h\] unknown key 'drivr'"),
    ("runv", {"pool": {"size": 1, "cpus": 2}}, r"\[handlers.h.pool\] unknown key 'cpus'"),
    ("runv", {"network": "br0"}, r"\[handlers.h\] network: expected a table, got 'br0'"),
]


@pytest.mark.parametrize(("kind", "config", "error"), CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_every_backend_refuses_a_bad_key_naming_section_and_key(
    tmp_path: Path, kind: str, config: dict[str, Any], error: str
) -> None:
    # The keys the shim adds to every handler are never unknown.
    full = {
        "type": kind,
        "state_dir": str(tmp_path),
        "pause_image": "p",
        "cgroup_driver": "cgroupfs",
        **config,
    }
    with pytest.raises(InvalidArgumentError, match=error):
        create_backend(kind, "h", full)


@pytest.mark.parametrize(
    ("kind", "good", "bad"),
    [
        (Kind.STR, "x", 1),
        (Kind.NUMBER, 0.5, -1),
        (Kind.INT, 3, 1.5),
        (Kind.BOOL, False, 0),
        (Kind.STRINGS, ["a"], ["a", 2]),
        (Kind.STR_MAP, {"a": "b"}, {"a": 1}),
        (Kind.TABLE, {}, []),
        (Kind.LIST, [], {}),
    ],
    ids=lambda v: v.name if isinstance(v, Kind) else None,
)
def test_kinds(kind: Kind, good: object, bad: object) -> None:
    assert kind.fits(good) and not kind.fits(bad)
    if kind is not Kind.BOOL:
        assert not kind.fits(True)  # TOML's booleans are never numbers or strings


def test_nested_sections_are_named_in_full() -> None:
    schema = {"a": {"b": {"c": Kind.INT}}}
    options.check("h", {"a": {"b": {"c": 1}}}, schema)
    with pytest.raises(InvalidArgumentError, match=r"\[handlers.h.a.b\] c: expected a non-negative integer"):
        options.check("h", {"a": {"b": {"c": "1"}}}, schema)
