"""The committed bindings are what scripts/gen-proto makes from cri_api/api.proto."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_generated_files_are_fresh() -> None:
    res = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen-proto"), "--check"], capture_output=True
    )
    assert res.returncode == 0, res.stdout.decode() + res.stderr.decode()


def test_schema_is_wire_identical_to_the_reference() -> None:
    """The reference is cri-api's main of 2026-07 (CheckpointPod, RestorePod, mount options,
    the SIGNAL_ prefix of the Signal values), as scripts/test checks it."""
    checker = ROOT.parent / "shared" / "tools" / "proto-compat"
    reference = ROOT.parent / "shared" / "cri" / "api-main-2026-07.proto"
    if not checker.exists() or not reference.exists():
        import pytest

        pytest.skip("../shared/tools/proto-compat or its 2026-07 reference is not beside this checkout")
    res = subprocess.run(
        [sys.executable, str(checker), str(ROOT / "cri_api" / "api.proto"), "--reference", str(reference)],
        capture_output=True,
    )
    assert res.returncode == 0, res.stdout.decode()
    assert b"893/893 wire items match" in res.stdout
