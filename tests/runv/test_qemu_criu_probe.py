"""Issue 43's probe: CRIU inside the qemu driver's guest (``runc checkpoint`` / ``runc restore``).

Needs the guest image built with CRIU (``scripts/runv-guest --criu --out DIR``, DIR from
``CRI_SHIM_CRIU_GUEST_DIR``, default /var/tmp/runv-guest-criu) and QEMU; skipped without
them (CI does not build that image). Two probes:

- by hand (``bench/criu_probe.py``): the guest booted with a probe in place of the agent;
  ``criu check`` passes, and a counting busybox container is checkpointed with
  ``--leave-running``, killed and restored, and counts on from where it was dumped;
- through the backend: a pod of the qemu driver, a counting container, and a privileged
  container in the VM's PID namespace whose exec enters the agent's mount namespace and
  runs the agent's runc on the counting container: checkpoint, stop, restore under a new
  name into the same bundle.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from backends.runv.backend import RunvBackend
from bench import criu_probe
from cri_api import api_pb2 as pb
from tests.runv.helpers import Events, MemorySink, container_record, sandbox_record, vm_support

CRIU_GUEST_DIR = os.environ.get("CRI_SHIM_CRIU_GUEST_DIR", criu_probe.DEFAULT_GUEST)
IMAGE = "test/busybox:1"
COUNTER = ["sh", "-c", "i=0; while true; do echo $i; i=$((i+1)); sleep 1; done"]
AGENT_RUNC = ["runc", "--root", "/run/runv/runc"]  # the agent's (--state /run/runv)


def criu_support() -> str:
    why = vm_support()
    if why:
        return why
    if shutil.which("qemu-system-x86_64") is None:
        return "qemu-system-x86_64 is not installed"
    try:
        with open(os.path.join(CRIU_GUEST_DIR, "manifest.json")) as fh:
            if not json.load(fh).get("criu"):
                return f"the guest image in {CRIU_GUEST_DIR} has no CRIU"
    except (OSError, ValueError):
        return f"no CRIU guest image in {CRIU_GUEST_DIR} (scripts/runv-guest --criu --out {CRIU_GUEST_DIR})"
    return ""


needs_criu_guest = pytest.mark.skipif(bool(criu_support()), reason=criu_support() or "ok")


def _steps(steps: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {str(s["step"]): s for s in steps}


def _counts_on(before: list[int], after: list[int]) -> bool:
    """The restored counter went on from a number the dumped one had reached (not from 0)."""
    return (
        bool(before and after)
        and 0 < after[0] <= before[-1] + 1
        and after == list(range(after[0], after[-1] + 1))
    )


@pytest.mark.slow
@pytest.mark.qemu
@needs_criu_guest
@pytest.mark.timeout(600)
def test_criu_checks_and_restores_a_container_in_the_guest() -> None:
    steps = _steps(criu_probe.probe(CRIU_GUEST_DIR, ["overlay", "podpid"]))
    dump = json.dumps(steps, indent=1)[-6000:]
    assert steps["vm"]["ended"], dump
    assert steps["criu-check"]["rc"] == 0 and "Looks good." in steps["criu-check"]["out"], dump
    for case in ("overlay", "podpid"):
        assert steps[f"{case}:checkpoint"]["rc"] == 0, dump
        assert steps[f"{case}:restore"]["rc"] == 0, dump
        before = steps[f"{case}:counted-before"]["numbers"]
        after = steps[f"{case}:counted-after"]["numbers"]
        assert _counts_on(before, after), (before, after)


def _in_vm(argv: list[str]) -> list[str]:
    """ARGV run in the agent's mount namespace (from a privileged container in the VM's PIDs)."""
    return ["busybox", "nsenter", "-t", "1", "-m", "--", *argv]


@pytest.mark.slow
@pytest.mark.qemu
@needs_criu_guest
@pytest.mark.timeout(900)
async def test_the_agents_runc_checkpoints_a_pods_container(
    runv_config: dict[str, Any], busybox_rootfs: Path
) -> None:
    cfg = {
        **runv_config,
        "driver": "qemu",
        "agent_timeout": 60.0,
        "qemu": {
            "guest_dir": CRIU_GUEST_DIR,
            "template": False,
            "cgroup_parent": runv_config["stub"]["cgroup_parent"],
            "capacity_vcpus": 4,
            "capacity_memory": 2 << 30,
        },
    }
    backend = RunvBackend("runv", cfg)
    ev = Events()
    await backend.lifecycle.start(ev)
    backend.image_store.import_dir(IMAGE, str(busybox_rootfs))
    sb = sandbox_record("criu")
    found: dict[str, Any] = {}
    try:
        await backend.lifecycle.run_sandbox(sb)
        sb.committed = True
        counter = container_record(sb, IMAGE, COUNTER, name="counter")
        await backend.lifecycle.create_container(counter, sb)
        sink = MemorySink()
        await ev.start(backend.lifecycle, counter, sb, sink)
        sc = pb.LinuxContainerSecurityContext(
            privileged=True, namespace_options=pb.NamespaceOption(pid=pb.NODE)
        )
        tool = container_record(
            sb, IMAGE, ["sleep", "3600"], name="tool", linux=pb.LinuxContainerConfig(security_context=sc)
        )
        await backend.lifecycle.create_container(tool, sb)
        await ev.start(backend.lifecycle, tool, sb, MemorySink())
        await asyncio.sleep(3)

        async def vm_exec(step: str, argv: list[str]) -> Any:
            loop = asyncio.get_running_loop()
            t = loop.time()
            res = await asyncio.wait_for(backend.exec.exec_sync(tool, _in_vm(argv)), 300)
            found[step] = {
                "argv": argv,
                "exit_code": res.exit_code,
                "seconds": round(loop.time() - t, 2),
                "stdout": res.stdout.decode(errors="replace")[-3000:],
                "stderr": res.stderr.decode(errors="replace")[-3000:],
            }
            print(step, json.dumps(found[step]))
            return res

        await vm_exec("list", [*AGENT_RUNC, "list"])
        img = "/run/criu-probe/img"
        res = await vm_exec(
            "checkpoint",
            [
                *AGENT_RUNC,
                "checkpoint",
                "--leave-running",
                "--image-path",
                img,
                "--work-path",
                "/run/criu-probe/dump",
                counter.id,
            ],
        )
        if res.exit_code != 0:
            await vm_exec("dump.log", ["tail", "-n", "30", "/run/criu-probe/dump/dump.log"])
        assert res.exit_code == 0, found
        await vm_exec("image", ["du", "-sk", img])
        await backend.lifecycle.stop_container(counter, 2)
        before = [int(x) for x in sink.data["stdout"].split() if x.isdigit()]
        bundle = f"/run/runv/containers/{counter.id}"
        # The restored container's stdout and stderr (the dumped ones were the agent's pipes,
        # which runc hands its own stdio in place of): a file, not the exec's stream, which
        # would stay open as long as the container runs.
        restore = " ".join(
            [
                *AGENT_RUNC,
                "restore",
                "-d",
                "--no-pivot",
                "--bundle",
                bundle,
                "--image-path",
                img,
                "--work-path",
                "/run/criu-probe/restore",
                counter.id[:32] + "-restored",
            ]
        )
        out = "/run/criu-probe/restored.out"
        res = await vm_exec("restore", ["sh", "-c", f"{restore} </dev/null >{out} 2>&1"])
        if res.exit_code != 0:
            await vm_exec(
                "restore.log", ["sh", "-c", f"cat {out}; tail -n 30 /run/criu-probe/restore/restore.log"]
            )
        await vm_exec("list-after", [*AGENT_RUNC, "list"])
        await asyncio.sleep(3)
        shown = await vm_exec("restored-output", ["cat", out])
        after = [int(x) for x in shown.stdout.split() if x.isdigit()]
        print("counted before", before, "after", after)
        assert res.exit_code == 0, found
        assert _counts_on(before, after), (before, after)
    finally:
        with contextlib.suppress(Exception):
            await backend.lifecycle.stop_sandbox(sb)
        await backend.lifecycle.close()
        await ev.close()
