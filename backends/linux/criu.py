"""Checkpoints on backends whose containers are real processes (docker, runv): they need CRIU.

Neither backend checkpoints yet. Its ``checkpoint`` part is :class:`NeedsCriu`, which answers
CheckpointContainer, CheckpointPod, RestorePod and a CreateContainer whose image is a checkpoint
archive with FailedPrecondition saying why: what ``criu check`` said on this host (run once, at
the first such call, with a timeout, as a child process the event loop waits for without
blocking), that no ``criu`` binary is installed, or, where CRIU works, that the backend does not
implement checkpoints yet. It writes nothing, so no half-written archive can be left, and
creates nothing. It does not look for images made from a checkpoint (``checkpoint_image`` is
False): such an image is created as the plain image it also is.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
from collections.abc import Mapping, Sequence

from backends.contract import ContainerCheckpoint, ContainerRecord, PodCheckpoint, SandboxRecord, errors
from cri_api import api_pb2 as pb

CHECK_TIMEOUT = 20.0  # seconds `criu check` may take
_SAID_MAX = 600  # characters of its output kept in the answer


async def criu_check(binary: str = "criu", timeout: float = CHECK_TIMEOUT) -> tuple[bool, str]:
    """Whether ``criu check`` passes on this host, and what it said (or why it could not run)."""
    path = await asyncio.to_thread(shutil.which, binary)
    if path is None:
        return False, f"the `{binary}` binary is not installed (not found on PATH)"
    try:
        proc = await asyncio.create_subprocess_exec(
            path,
            "check",
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
    except OSError as exc:
        return False, f"cannot run `{path} check`: {exc}"
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), timeout)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()
        return False, f"`{path} check` did not finish in {timeout:g} s"
    said = " / ".join(line.strip() for line in out.decode(errors="replace").splitlines() if line.strip())
    if len(said) > _SAID_MAX:
        said = said[:_SAID_MAX] + "..."
    if proc.returncode == 0:
        return True, said or "Looks good."
    return False, f"`{path} check` failed (exit status {proc.returncode}): {said or '(no output)'}"


class NeedsCriu:
    """The Checkpoint part of a backend that would checkpoint with CRIU: every call refused with
    FailedPrecondition naming CRIU and what ``criu check`` said (see the module's doc)."""

    def __init__(self, handler: str, binary: str = "criu", timeout: float = CHECK_TIMEOUT) -> None:
        self.handler = handler
        self.binary = binary
        self.timeout = timeout
        self._verdict: asyncio.Future[tuple[bool, str]] | None = None

    async def verdict(self) -> tuple[bool, str]:
        """``criu check``'s, run at the first call only (callers meanwhile wait for that one)."""
        if self._verdict is None:
            self._verdict = asyncio.ensure_future(criu_check(self.binary, self.timeout))
        return await asyncio.shield(self._verdict)

    async def _refuse(self, what: str) -> errors.FailedPreconditionError:
        works, said = await self.verdict()
        if works:
            why = f"CRIU works here (`criu check`: {said}), but {what} is not implemented on this backend yet"
        else:
            why = f"{what} needs CRIU, which cannot checkpoint on this host: {said}"
        return errors.FailedPreconditionError(f"runtime handler {self.handler!r}: {why}")

    async def checkpoint_container(self, container: ContainerRecord, location: str, timeout: int) -> None:
        raise await self._refuse("CheckpointContainer")

    async def checkpoint_pod(
        self,
        sandbox: SandboxRecord,
        containers: Sequence[ContainerRecord],
        output_dir: str,
        options: Mapping[str, str],
    ) -> None:
        raise await self._refuse("CheckpointPod")

    async def open_pod_checkpoint(
        self, path: str, options: Mapping[str, str], configs: Sequence[pb.ContainerConfig]
    ) -> PodCheckpoint:
        raise await self._refuse("RestorePod")

    async def restore_container(
        self,
        container: ContainerRecord,
        sandbox: SandboxRecord,
        checkpoint: PodCheckpoint | ContainerCheckpoint,
    ) -> None:
        what = "RestorePod" if isinstance(checkpoint, PodCheckpoint) else "CreateContainer from a checkpoint"
        raise await self._refuse(what)

    def checkpoint_image(self, image: str) -> bool:
        return False  # not looked for (the module's doc)

    async def open_container_checkpoint(self, source: str) -> ContainerCheckpoint:
        raise await self._refuse("CreateContainer from a checkpoint")
