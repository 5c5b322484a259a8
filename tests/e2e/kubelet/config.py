"""The files and command lines the harness starts the kubelet and the shim with."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from backends.runv import guest_image
from tests.cni import realnet
from tests.e2e.kubelet import host

if TYPE_CHECKING:
    from tests.e2e.kubelet.runner import Harness

REPO = Path(__file__).resolve().parents[3]


def kubelet_config(h: Harness) -> str:
    # JSON is YAML: the kubelet reads either.
    cfg = {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "address": "127.0.0.1",
        "port": h.port,
        "readOnlyPort": 0,
        "healthzBindAddress": "127.0.0.1",
        "healthzPort": h.healthz_port,
        "staticPodPath": str(h.manifest_dir),
        "fileCheckFrequency": "2s",
        "syncFrequency": "10s",
        "cgroupDriver": "cgroupfs",
        "failSwapOn": False,
        "authentication": {
            "anonymous": {"enabled": True},
            "webhook": {"enabled": False},
            "x509": {},
        },
        "authorization": {"mode": "AlwaysAllow"},
        # No kubepods cgroup hierarchy: the runtime places pods itself.
        "cgroupsPerQOS": False,
        "enforceNodeAllocatable": [],
        "protectKernelDefaults": False,
        # Stays true (the default): false also drops cAdvisor's disk metrics,
        # and /stats/summary then fails ("failed to get rootFs info").
        "localStorageCapacityIsolation": True,
        # root lacks CAP_SYS_RESOURCE here: a negative oom_score_adj fails.
        "oomScoreAdj": 0,
        # Leave the host's iptables alone.
        "makeIPTablesUtilChains": False,
        "serializeImagePulls": False,
        # A busy shared disk must not evict or garbage-collect the test images.
        "evictionHard": {"memory.available": "1Mi", "nodefs.available": "1%", "imagefs.available": "1%"},
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        "resolvConf": "/etc/resolv.conf",
    }
    if h.qos:
        cfg["cgroupsPerQOS"] = True
        cfg["cgroupRoot"] = h.cgroup_root
    if h.kubelet_minor >= host.POD_LOGS_DIR_SINCE:
        cfg["podLogsDir"] = str(h.pod_logs_dir)  # not the shared /var/log/pods (host.py says why)
    if h.stop_signals:
        cfg["featureGates"] = {"ContainerStopSignals": True}  # alpha in v1.33-v1.35
    if h.cni is not None:
        # A standalone kubelet hands it to the runtime (UpdateRuntimeConfig) as it starts.
        cfg["podCIDR"] = str(h.cni.net.subnet)
    path = h.dir / "kubelet.yaml"
    path.write_text(json.dumps(cfg, indent=2))
    return str(path)


def shim_config(h: Harness) -> str:
    lines = [
        "[server]",
        f'transport = "{h.transport}"',
        "[images]",
        f'pause_image = "{h.pause}"',
        "[streaming]",
        'address = "127.0.0.1"',
        "[logging]",
        'level = "info"',
        # The host's /var/run/nri/nri.sock is for the runtime of the host (or a test that dials it):
        # NRI stays on, on a socket of the run's own.
        "[nri]",
        f'socket_path = "{h.dir}/nri.sock"',
    ]
    pod_network = ['pod_network = "cni"'] if h.cni is not None else []
    if h.handler == "runv":
        tag = h.tag
        lines += [
            "[handlers.runv]",
            'type = "runv"',
            *pod_network,
            f'root = "{h.dir}/runv"',
            f'run_dir = "{h.dir}/rv"',  # short: agent socket paths must fit in sun_path
            "[handlers.runv.network]",
            f'bridge = "rvk{tag}"',
            f'subnet = "10.94.{h.subnet_octet}.0/24"',
            f'ipam_dir = "{h.dir}/ipam"',
            f'hostport_chain = "CRISHIM-K-{tag}"',
            "[handlers.runv.stub]",
            f'cgroup_parent = "cri-shim-runv-e2e-{tag}"',
        ]
        if h.driver == "qemu":
            lines.insert(lines.index('type = "runv"') + 1, 'driver = "qemu"')
            lines += runv_qemu_table("runv", f"cri-shim-runv-e2e-{tag}", h.guest_dir)
        if h.warm:
            lines += ["[handlers.runv.pool]", f"size = {h.warm}"]
    elif h.handler == "fake" and h.available_images is not None:
        lines += ["[handlers.fake]", 'type = "fake"', f"available_images = {json.dumps(h.available_images)}"]
    elif h.handler == "docker":
        # An instance of the run's own: a docker shim's recovery removes the engine containers of its
        # instance that its records do not claim, so two runs on the default instance ("docker")
        # on one engine removed each other's pods whenever one restarted.
        lines += ["[handlers.docker]", 'type = "docker"', f'instance = "e2e-{h.tag}"', *pod_network]
        if h.warm:
            # Warm pause containers serve the host-network pods (backends/docker/warm.py).
            lines += ["[handlers.docker.pool]", f"size = {h.warm}"]
    if h.cni is not None:
        template = h.dir / "cni.tmpl"
        template.write_text(h.cni.template())
        lines += [
            "[cni]",
            f'conf_dir = "{h.cni.net.conf_dir}"',
            f'bin_dirs = ["{realnet.PLUGIN_DIR}"]',
            f'conf_template = "{template}"',
        ]
    path = h.dir / "cri-shim.toml"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def runv_qemu_table(handler: str, cgroup_parent: str, guest_dir: str = "") -> list[str]:
    """The ``[handlers.NAME.qemu]`` table of a runv handler with ``driver = "qemu"`` (the kubelet
    harness's and the cluster's runv node's): the run's cgroup parent, the guest image when not the
    driver's default; the rest the driver's defaults (TCG here, templates and virtio-fs on)."""
    lines = [f"[handlers.{handler}.qemu]", f'cgroup_parent = "{cgroup_parent}"']
    if guest_dir:
        lines.append(f'guest_dir = "{guest_dir}"')
    return lines


def runv_qemu_problem(guest_dir: str = "") -> str | None:
    """Why runv's qemu driver cannot start VMs here (no QEMU, no guest image), or None."""
    if shutil.which("qemu-system-x86_64") is None:
        return "runv qemu: qemu-system-x86_64 is not installed (bash scripts/runv-guest installs it)"
    where = Path(guest_dir or guest_image.DEFAULT_OUT)
    for name in ("vmlinuz", "initrd.img"):
        if not (where / name).is_file():
            return f"runv qemu: no {name} in {where} (bash scripts/runv-guest --if-missing)"
    return None


def shim_command() -> list[str]:
    exe = REPO / ".venv" / "bin" / "cri-shim"
    if exe.exists():
        return [str(exe)]
    return [sys.executable, "-c", "import sys; from shim.cli import main; sys.exit(main())"]
