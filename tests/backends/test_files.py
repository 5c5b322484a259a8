"""A file replaced whole or not at all (backends.linux.files)."""

from __future__ import annotations

from pathlib import Path

import pytest

from backends.linux.files import replacing, write_atomic


def test_write_atomic_replaces_the_content_and_leaves_no_temporary_file(tmp_path: Path) -> None:
    path = tmp_path / "index.json"
    path.write_bytes(b"old")
    write_atomic(str(path), b"new")
    assert path.read_bytes() == b"new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["index.json"]


def test_a_failed_write_leaves_the_old_content_and_no_temporary_file(tmp_path: Path) -> None:
    path = tmp_path / "blob"
    path.write_bytes(b"old")
    with pytest.raises(ValueError, match="digest mismatch"), replacing(str(path)) as f:
        f.write(b"half of the new")
        raise ValueError("digest mismatch")
    assert path.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["blob"]
