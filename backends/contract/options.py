"""The one checker of a handler's options (its ``[handlers.NAME]`` table), for every backend.

Each backend describes its keys as a schema: key -> :class:`Kind`, or key -> a nested schema for a
sub-table (``pool``, ``network``...). :func:`check` applies one rule everywhere: an unknown key is an
error naming the section and the key, and so is a value of the wrong kind. Without it a misspelt key
is silently ignored and fails much later (a pod on the wrong bridge, a pool that never fills).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Any, TypeAlias

from backends.contract.errors import InvalidArgumentError


class Kind(enum.Enum):
    """What a value may be; the enum's value is how an error names it."""

    STR = "a string"
    NUMBER = "a non-negative number"
    INT = "a non-negative integer"
    BOOL = "true or false"
    STRINGS = "a list of strings"
    STR_MAP = "a table of strings"
    TABLE = "a table"  # free-form: the backend reads and checks its content itself
    LIST = "a list"  # free-form, likewise

    def fits(self, value: Any) -> bool:
        if self is Kind.BOOL:
            return isinstance(value, bool)
        if isinstance(value, bool):
            return False  # TOML true/false is never a number or a string
        match self:
            case Kind.STR:
                return isinstance(value, str)
            case Kind.NUMBER:
                return isinstance(value, int | float) and value >= 0
            case Kind.INT:
                return isinstance(value, int) and value >= 0
            case Kind.STRINGS:
                return isinstance(value, list) and all(isinstance(v, str) for v in value)
            case Kind.STR_MAP:
                return isinstance(value, Mapping) and all(isinstance(v, str) for v in value.values())
            case Kind.TABLE:
                return isinstance(value, Mapping)
            case _:
                return isinstance(value, list)


Schema: TypeAlias = Mapping[str, "Kind | Schema"]

# Keys the shim adds to every handler's options, whatever its type (shim.server); a backend may
# have no use for some of them, but they are never unknown.
SHIM_KEYS: Schema = {
    "type": Kind.STR,
    "state_dir": Kind.STR,
    "pause_image": Kind.STR,
    # The [images] section (shim.config.ImagesConfig): how a store pulls, and what it pins.
    "image_pull_progress_timeout": Kind.NUMBER,
    "pull_no_progress_timeout": Kind.NUMBER,  # the old name of image_pull_progress_timeout
    "registry_config_path": Kind.STR,
    "credentials_file": Kind.STR,
    "max_concurrent_downloads": Kind.INT,
    "pinned": Kind.STRINGS,
    "cgroup_driver": Kind.STR,
    "cni": Kind.TABLE,  # the node's CNI settings (the [cni] section), read by backends.cni.pods
}


def pull_progress_timeout(options: Mapping[str, Any], default: float) -> float:
    """Seconds a pull may go without a byte (0: no limit): ``image_pull_progress_timeout``, or
    the key's old name ``pull_no_progress_timeout``, or ``default``."""
    for key in ("image_pull_progress_timeout", "pull_no_progress_timeout"):
        if key in options:
            return float(options[key])
    return default


def check(handler: str, options: Mapping[str, Any], schema: Schema) -> None:
    """Raise InvalidArgumentError naming ``[handlers.HANDLER...]`` and the key for the first bad key."""
    check_section(f"handlers.{handler}", options, {**SHIM_KEYS, **schema})


def check_section(section: str, data: object, schema: Schema) -> None:
    """The same for one table, ``section`` as a TOML header names it (``handlers.docker.pool``)."""
    if not isinstance(data, Mapping):
        raise InvalidArgumentError(f"[{section}]: expected a table, got {data!r}")
    for key, value in data.items():
        kind = schema.get(key)
        if kind is None:
            known = ", ".join(sorted(schema))
            raise InvalidArgumentError(f"[{section}] unknown key {key!r} (known: {known})")
        if isinstance(kind, Kind):
            if not kind.fits(value):
                raise InvalidArgumentError(f"[{section}] {key}: expected {kind.value}, got {value!r}")
        elif not isinstance(value, Mapping):
            raise InvalidArgumentError(f"[{section}] {key}: expected a table, got {value!r}")
        else:
            check_section(f"{section}.{key}", value, kind)
