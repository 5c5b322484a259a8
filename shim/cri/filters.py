"""The label selector of the List RPCs' filters, as the CRI defines it: every pair must hold."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, TypeVar


class Labelled(Protocol):
    # config.labels as a dict, made at the first label-filtered List and kept on the record
    # (a record's labels never change).
    label_map: dict[str, str] | None

    @property
    def config(self) -> Any: ...


def record_labels(r: Labelled) -> dict[str, str]:
    """The record's config.labels as a plain dict, kept on it."""
    labels = r.label_map
    if labels is None:
        labels = r.label_map = dict(r.config.labels)
    return labels


L = TypeVar("L", bound=Labelled)


def with_labels(records: list[L], selector: Mapping[str, str]) -> list[L]:
    """The records whose labels hold every pair of ``selector`` (all of them if it is empty)."""
    if not selector:
        return records
    pairs = tuple(selector.items())
    kept = []
    for r in records:
        labels = r.label_map or record_labels(r)
        for k, v in pairs:
            if labels.get(k) != v:
                break
        else:
            kept.append(r)
    return kept
