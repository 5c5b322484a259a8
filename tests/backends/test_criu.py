"""docker's and runv's checkpoint part: refused with what `criu check` says, found with a stub
`criu` on PATH (a script), so that this runs on any machine."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from backends.contract import ContainerRecord, PodCheckpoint, SandboxRecord
from backends.contract.errors import FailedPreconditionError
from backends.linux.criu import NeedsCriu
from cri_api import api_pb2 as pb

# What Debian's CRIU 3.17 says on a kernel whose vDSO it does not know.
VDSO = "Error (criu/vdso.c:381): vdso: Unexpected rt vDSO area bounds"


def stub_criu(bin_dir: Path, body: str) -> Path:
    """A `criu` in ``bin_dir`` that runs ``body`` (sh) and counts its runs in ``bin_dir/runs``."""
    bin_dir.mkdir(exist_ok=True)
    script = bin_dir / "criu"
    script.write_text(f'#!/bin/sh\necho run >> "{bin_dir}/runs"\n{body}\n')
    script.chmod(0o755)
    return script


def runs(bin_dir: Path) -> int:
    p = bin_dir / "runs"
    return len(p.read_text().splitlines()) if p.exists() else 0


def records() -> tuple[SandboxRecord, ContainerRecord]:
    sb = SandboxRecord(id="a" * 64, handler="", backend="docker", config=pb.PodSandboxConfig(), created_at=0)
    c = ContainerRecord(
        id="b" * 64,
        sandbox_id=sb.id,
        backend="docker",
        config=pb.ContainerConfig(),
        created_at=0,
        log_path="",
    )
    return sb, c


async def refusal(part: NeedsCriu, tmp_path: Path) -> list[str]:
    sb, c = records()
    calls = [
        part.checkpoint_container(c, str(tmp_path / "c.tar"), 0),
        part.checkpoint_pod(sb, [c], str(tmp_path), {}),
        part.open_pod_checkpoint(str(tmp_path), {}, [pb.ContainerConfig()]),
        part.restore_container(c, sb, PodCheckpoint(())),
    ]
    said = []
    for call in calls:
        with pytest.raises(FailedPreconditionError) as got:
            await call
        said.append(str(got.value))
    return said


async def test_a_failing_criu_check_is_said_and_run_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bin_dir = tmp_path / "bin"
    stub_criu(
        bin_dir, f'echo "{VDSO}" >&2\necho "Error (criu/crtools.c:260): Could not initialize" >&2\nexit 1'
    )
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    part = NeedsCriu("docker")
    out = tmp_path / "out"
    out.mkdir()
    said = await refusal(part, out)
    for what, message in zip(
        ["CheckpointContainer", "CheckpointPod", "RestorePod", "RestorePod"], said, strict=True
    ):
        assert message.startswith("runtime handler 'docker': " + what + " needs CRIU"), message
        assert "Unexpected rt vDSO area bounds" in message and "exit status 1" in message, message
    assert runs(bin_dir) == 1  # once, whatever the number of calls
    assert os.listdir(out) == []  # nothing written


async def test_concurrent_first_calls_share_one_check(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bin_dir = tmp_path / "bin"
    stub_criu(bin_dir, "sleep 0.2\necho nope >&2\nexit 1")
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    part = NeedsCriu("runv")
    got = await asyncio.gather(part.verdict(), part.verdict(), part.verdict())
    assert got == [(False, got[0][1])] * 3 and "nope" in got[0][1]
    assert runs(bin_dir) == 1


async def test_no_criu_installed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # nothing there
    said = await refusal(NeedsCriu("runv"), tmp_path)
    assert all("the `criu` binary is not installed" in m for m in said), said


async def test_a_criu_that_works_is_still_not_used_yet(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bin_dir = tmp_path / "bin"
    stub_criu(bin_dir, 'echo "Looks good."')
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    said = await refusal(NeedsCriu("docker"), tmp_path)
    assert all("not implemented on this backend yet" in m and "Looks good." in m for m in said), said


async def test_a_hanging_criu_check_times_out(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bin_dir = tmp_path / "bin"
    stub_criu(bin_dir, "exec sleep 30")
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    works, said = await NeedsCriu("docker", timeout=0.5).verdict()
    assert not works and "did not finish in 0.5 s" in said
    assert loop.time() - t0 < 5
