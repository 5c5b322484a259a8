"""Issue 43's probe: CRIU inside the qemu driver's guest (``runc checkpoint`` / ``runc restore``).

Needs the guest image built with CRIU (``scripts/runv-guest --criu --out DIR``, DIR from
``CRI_SHIM_CRIU_GUEST_DIR``, default /var/lib/cri-shim/runv-guest-criu) and QEMU; skipped without
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
import uuid
from pathlib import Path
from typing import Any

import pytest

from backends.runv import guest_image
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


def test_criu_is_an_option_of_the_guest_image(tmp_path: Path) -> None:
    """Off by default (the default image's recipe and /init do not change); on, another recipe
    whose /init moves the root off the initramfs before anything else."""
    assert guest_image.init_script() == guest_image.INIT
    assert guest_image.recipe(criu=True) != guest_image.recipe()
    init = guest_image.init_script(criu=True)
    assert init.startswith("#!/bin/busybox sh\n# runv guest init")
    assert (
        init.index("mount --move . /")
        < init.index("--install -s /bin")
        < init.index("exec /usr/bin/python3.11")
    )
    (tmp_path / "vmlinuz").write_text("")
    (tmp_path / "initrd.img").write_text("")
    (tmp_path / "manifest.json").write_text(json.dumps({"recipe": guest_image.recipe(criu=True)}))
    assert guest_image.current(str(tmp_path), criu=True) and not guest_image.current(str(tmp_path))


def test_a_restored_counter_must_count_on() -> None:
    assert _counts_on([0, 1, 2, 3, 4, 5], [3, 4, 5, 6])
    assert not _counts_on([0, 1, 2, 3], [0, 1, 2])  # started again
    assert not _counts_on([0, 1, 2, 3], [])  # nothing
    assert not _counts_on([0, 1, 2, 3], [3, 5])  # not one process


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


def _numbers(data: bytes) -> list[int]:
    return [int(x) for x in data.split() if x.isdigit()]


def _backend_config(runv_config: dict[str, Any]) -> dict[str, Any]:
    return {
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


class Pod:
    """A pod of the backend with a privileged ``tool`` container in the VM's PID namespace,
    whose execs run in the agent's mount namespace (what a checkpoint operation of the agent
    would do itself); each exec's outcome is kept in ``found``."""

    def __init__(self, backend: RunvBackend, ev: Events, name: str, xfer: Path) -> None:
        self.backend, self.ev, self.xfer = backend, ev, xfer
        self.sb = sandbox_record(name)
        self.found: dict[str, Any] = {}

    async def start(self, counter_started: bool = True) -> None:
        lc = self.backend.lifecycle
        await lc.run_sandbox(self.sb)
        self.sb.committed = True
        self.counter = container_record(self.sb, IMAGE, COUNTER, name="counter")
        await lc.create_container(self.counter, self.sb)
        self.sink = MemorySink()
        if counter_started:
            await self.ev.start(lc, self.counter, self.sb, self.sink)
        sc = pb.LinuxContainerSecurityContext(
            privileged=True, namespace_options=pb.NamespaceOption(pid=pb.NODE)
        )
        self.tool = container_record(
            self.sb,
            IMAGE,
            ["sleep", "3600"],
            name="tool",
            linux=pb.LinuxContainerConfig(security_context=sc),
            mounts=[pb.Mount(container_path="/xfer", host_path=str(self.xfer))],
        )
        await lc.create_container(self.tool, self.sb)
        await self.ev.start(lc, self.tool, self.sb, MemorySink())

    async def vm_exec(self, step: str, argv: list[str]) -> Any:
        loop = asyncio.get_running_loop()
        t = loop.time()
        res = await asyncio.wait_for(self.backend.exec.exec_sync(self.tool, _in_vm(argv)), 300)
        self.found[step] = {
            "argv": argv,
            "exit_code": res.exit_code,
            "seconds": round(loop.time() - t, 2),
            "stdout": res.stdout.decode(errors="replace")[-3000:],
            "stderr": res.stderr.decode(errors="replace")[-3000:],
        }
        print(self.sb.config.metadata.name, step, json.dumps(self.found[step]))
        return res

    async def checkpoint(self, img: str) -> None:
        work = "/run/criu-probe/dump"
        argv = [*AGENT_RUNC, "checkpoint", "--leave-running", "--image-path", img, "--work-path", work]
        res = await self.vm_exec("checkpoint", [*argv, self.counter.id])
        if res.exit_code != 0:
            await self.vm_exec("dump.log", ["tail", "-n", "30", f"{work}/dump.log"])
        assert res.exit_code == 0, self.found
        await self.vm_exec("image", ["du", "-sk", img])

    async def restore(self, img: str, bundle_of: str) -> list[int]:
        """Restore IMG as a new runc container in the bundle of container BUNDLE_OF; what it counts."""
        # The restored container's stdout and stderr (the dumped ones were the agent's pipes,
        # which runc hands its own stdio in place of): a file, not the exec's stream, which
        # would stay open as long as the container runs.
        work, out = "/run/criu-probe/restore", "/run/criu-probe/restored.out"
        bundle = f"/run/runv/containers/{bundle_of}"
        argv = [*AGENT_RUNC, "restore", "-d", "--no-pivot", "--bundle", bundle, "--image-path", img]
        argv += ["--work-path", work, bundle_of[:32] + "-restored"]
        res = await self.vm_exec("restore", ["sh", "-c", f"{' '.join(argv)} </dev/null >{out} 2>&1"])
        if res.exit_code != 0:
            await self.vm_exec("restore.log", ["sh", "-c", f"cat {out}; tail -n 30 {work}/restore.log"])
        assert res.exit_code == 0, self.found
        await self.vm_exec("list-after", [*AGENT_RUNC, "list"])
        await asyncio.sleep(3)
        return _numbers((await self.vm_exec("restored-output", ["cat", out])).stdout)

    async def xfer_dir(self, marker: str) -> str:
        """Where the VM sees the host's ``xfer`` directory (found by a file of that name)."""
        res = await self.vm_exec("xfer", ["find", "/run/runv/shares", "-name", marker])
        assert res.exit_code == 0 and res.stdout.strip(), self.found
        return res.stdout.decode().split()[0].rsplit("/", 1)[0]


@pytest.fixture
async def criu_backend(runv_config: dict[str, Any], busybox_rootfs: Path) -> Any:
    backend = RunvBackend("runv", _backend_config(runv_config))
    ev = Events()
    await backend.lifecycle.start(ev)
    backend.image_store.import_dir(IMAGE, str(busybox_rootfs))
    pods: list[Pod] = []
    yield backend, ev, pods
    for pod in pods:
        with contextlib.suppress(Exception):
            await backend.lifecycle.stop_sandbox(pod.sb)
    await backend.lifecycle.close()
    await ev.close()


@pytest.mark.slow
@pytest.mark.qemu
@needs_criu_guest
@pytest.mark.timeout(600)
async def test_the_agents_runc_checkpoints_and_restores_a_pods_container(
    criu_backend: Any, tmp_path: Path
) -> None:
    backend, ev, pods = criu_backend
    pod = Pod(backend, ev, "criu", tmp_path)
    pods.append(pod)
    await pod.start()
    await asyncio.sleep(3)
    await pod.vm_exec("list", [*AGENT_RUNC, "list"])
    img = "/run/criu-probe/img"
    await pod.checkpoint(img)
    await backend.lifecycle.stop_container(pod.counter, 2)
    before = _numbers(bytes(pod.sink.data["stdout"]))
    after = await pod.restore(img, pod.counter.id)
    print("counted before", before, "after", after)
    assert _counts_on(before, after), (before, after)


@pytest.mark.slow
@pytest.mark.qemu
@needs_criu_guest
@pytest.mark.timeout(900)
async def test_a_checkpoint_is_restored_in_another_vm(criu_backend: Any, tmp_path: Path) -> None:
    """RestorePod's path: the images reach the host through a share, a new VM restores them in
    the bundle of a container created there (not started: its runc init removed first, so
    that the pod's PIDs are free)."""
    backend, ev, pods = criu_backend
    marker = ".criu-xfer-" + uuid.uuid4().hex[:8]
    (tmp_path / marker).write_text("")
    first = Pod(backend, ev, "criu-a", tmp_path)
    pods.append(first)
    await first.start()
    await asyncio.sleep(3)
    img = "/run/criu-probe/img"
    await first.checkpoint(img)
    share = await first.xfer_dir(marker)
    res = await first.vm_exec("to-host", ["cp", "-a", img, f"{share}/img"])
    assert res.exit_code == 0, first.found
    await backend.lifecycle.stop_container(first.counter, 2)
    before = _numbers(bytes(first.sink.data["stdout"]))
    await backend.lifecycle.stop_sandbox(first.sb)
    print("host has", sorted(os.listdir(tmp_path / "img")))

    second = Pod(backend, ev, "criu-b", tmp_path)
    pods.append(second)
    await second.start(counter_started=False)
    share = await second.xfer_dir(marker)
    res = await second.vm_exec("drop-created", [*AGENT_RUNC, "delete", "--force", second.counter.id])
    assert res.exit_code == 0, second.found
    res = await second.vm_exec(
        "from-host", ["sh", "-c", f"mkdir -p /run/criu-probe && cp -a {share}/img {img}"]
    )
    assert res.exit_code == 0, second.found
    after = await second.restore(img, second.counter.id)
    print("counted before", before, "after", after)
    assert _counts_on(before, after), (before, after)
