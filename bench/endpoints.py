"""The CRI endpoints the benchmarks drive, and how they time them.

- `Cri`: one CRI endpoint (cri-shim, containerd, cri-dockerd, ...) through grpcio: pods and
  containers made with this run's labels, the lifecycle timed step by step, the cleanup;
- `Raw`: the same lifecycle straight through the Docker Engine (the docker SDK);
- `Shim`: `cri-shim serve` on the docker backend as a child process, on a temporary
  socket, state directory and config, and the removal of what it leaves on the engine;
- the images, sockets and timeouts they share; `pct` (nearest-rank percentile), `clock`;
  `machine_ticks` and `wait_quiet` (how busy the machine's CPUs are, from /proc/stat);
- `registry_images`, `fill_images`, `remove_bench_images`: distinct images made in the test
  registry, pulled through CRI until an endpoint lists a number of them, removed after.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import json
import math
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import docker
import grpc

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from cri_api import api_pb2 as pb  # noqa: E402
from cri_api import api_pb2_grpc  # noqa: E402

BUSYBOX = "127.0.0.1:5000/busybox:1.36"
PAUSE = "127.0.0.1:5000/pause:3.10"
DOCKER_SOCK = "unix:///var/run/docker.sock"
CONTAINERD_SOCK = "/run/containerd-cri/containerd.sock"
# Stop grace of the app container: sleep as PID 1 ignores SIGTERM, so any
# grace would be spent waiting; 0 measures the stop path itself (SIGKILL).
APP_STOP_TIMEOUT = 0
# Grace the docker backend gives the pause container (backends/docker/sandbox.py
# _STOP_PAUSE_TIMEOUT); pause exits at once on SIGTERM, so it is never waited for.
PAUSE_STOP_TIMEOUT = 10
# Label on every raw-engine container of this run, for the cleanup.
RAW_LABEL = "cri-shim-bench.run"

OPS = [
    "RunPodSandbox",
    "CreateContainer",
    "StartContainer",
    "ContainerStatus",
    "PodSandboxStatus",
    "ListContainers",
    "StopContainer",
    "RemoveContainer",
    "StopPodSandbox",
    "RemovePodSandbox",
]
# What the raw engine does for each operation.
RAW_WORK = {
    "RunPodSandbox": "create+start pause",
    "CreateContainer": "create (container: net+ipc)",
    "StartContainer": "start",
    "ContainerStatus": "inspect app",
    "PodSandboxStatus": "inspect pause",
    "ListContainers": "list (label filter)",
    "StopContainer": f"stop (t={APP_STOP_TIMEOUT})",
    "RemoveContainer": "remove",
    "StopPodSandbox": "stop pause",
    "RemovePodSandbox": "remove pause",
}

Samples = dict[str, list[float]]


def pct(samples: list[float], q: float) -> float:
    """Nearest-rank percentile."""
    if not samples:
        return math.nan
    s = sorted(samples)
    return s[max(0, math.ceil(q * len(s)) - 1)]


def machine_ticks() -> tuple[int, int]:
    """(busy, all) jiffies of every CPU so far, from /proc/stat's first line (iowait counts as idle)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return sum(fields) - idle, sum(fields)


def wait_quiet(limit: float, busy_max: float, window: float = 2.0) -> tuple[float, float]:
    """Until the CPUs were at most ``busy_max`` busy (0-1) over ``window`` s, or ``limit`` s passed.

    Returns (seconds waited, the last window's busy fraction)."""
    t0 = time.monotonic()
    while True:
        b0, a0 = machine_ticks()
        time.sleep(window)
        b1, a1 = machine_ticks()
        busy = (b1 - b0) / max(1, a1 - a0)
        waited = time.monotonic() - t0
        if busy <= busy_max or waited >= limit:
            return waited, busy


@contextlib.contextmanager
def clock(samples: Samples, op: str) -> Iterator[None]:
    t0 = time.perf_counter()
    yield
    samples.setdefault(op, []).append((time.perf_counter() - t0) * 1000)


# ---------------------------------------------------------------- CRI (cri-shim and containerd)


def pod_sandbox_config(
    name: str, namespace: str, uid: str, log_dir: str, labels: dict[str, str]
) -> pb.PodSandboxConfig:
    """A benchmark pod's config (hostname = name), with its log directory made."""
    os.makedirs(log_dir, exist_ok=True)
    return pb.PodSandboxConfig(
        metadata=pb.PodSandboxMetadata(name=name, namespace=namespace, uid=uid),
        hostname=name,
        log_directory=log_dir,
        labels=labels,
    )


class Cri:
    """One CRI endpoint; remembers the pods it made so that they can be removed."""

    def __init__(self, name: str, sock: str, run_id: str, log_dir: str) -> None:
        self.name = name
        self.sock = sock
        self.run_id = run_id
        self.log_dir = log_dir
        self.channel = grpc.insecure_channel(f"unix://{sock}")
        # The generated stubs carry no annotations.
        self.rt = api_pb2_grpc.RuntimeServiceStub(self.channel)  # type: ignore[no-untyped-call]
        self.im = api_pb2_grpc.ImageServiceStub(self.channel)  # type: ignore[no-untyped-call]
        self.pods: set[str] = set()
        self.seq = 0

    def wait_ready(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while True:
            try:
                self.rt.Version(pb.VersionRequest(), timeout=2)
                return
            except grpc.RpcError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    def answers(self) -> bool:
        if not os.path.exists(self.sock):
            return False
        try:
            self.rt.Version(pb.VersionRequest(), timeout=3)
            return True
        except grpc.RpcError:
            return False

    def pull(self) -> None:
        """Pull the app image unless the runtime has it (untimed: others share the engine and may remove it)."""
        spec = pb.ImageSpec(image=BUSYBOX)
        if not self.im.ImageStatus(pb.ImageStatusRequest(image=spec), timeout=60).HasField("image"):
            self.im.PullImage(pb.PullImageRequest(image=spec), timeout=300)

    def pod_config(self) -> pb.PodSandboxConfig:
        self.seq += 1
        sc = pod_sandbox_config(
            f"bench-{self.seq}",
            f"cri-shim-bench-{self.run_id}",
            f"{self.run_id}-{self.seq}",
            os.path.join(self.log_dir, f"{self.name}-{self.seq}"),
            {"cri-shim-bench": self.run_id},
        )
        sc.linux.security_context.namespace_options.pid = pb.CONTAINER
        return sc

    def container_config(self, name: str) -> pb.ContainerConfig:
        return pb.ContainerConfig(
            metadata=pb.ContainerMetadata(name=name),
            image=pb.ImageSpec(image=BUSYBOX),
            command=["sleep", "3600"],
            log_path=f"{name}.log",
            labels={"cri-shim-bench": self.run_id},
            linux=pb.LinuxContainerConfig(
                security_context=pb.LinuxContainerSecurityContext(
                    namespace_options=pb.NamespaceOption(pid=pb.CONTAINER)
                )
            ),
        )

    def run_pod(self, sc: pb.PodSandboxConfig) -> str:
        pod = str(self.rt.RunPodSandbox(pb.RunPodSandboxRequest(config=sc), timeout=120).pod_sandbox_id)
        self.pods.add(pod)
        return pod

    def create(self, pod: str, sc: pb.PodSandboxConfig, name: str) -> str:
        req = pb.CreateContainerRequest(
            pod_sandbox_id=pod, config=self.container_config(name), sandbox_config=sc
        )
        return str(self.rt.CreateContainer(req, timeout=120).container_id)

    def lifecycle(self, samples: Samples, repeat: int) -> None:
        rt = self.rt
        sc = self.pod_config()
        with clock(samples, "RunPodSandbox"):
            pod = self.run_pod(sc)
        req = pb.CreateContainerRequest(
            pod_sandbox_id=pod, config=self.container_config("app"), sandbox_config=sc
        )
        with clock(samples, "CreateContainer"):
            cid = rt.CreateContainer(req, timeout=120).container_id
        with clock(samples, "StartContainer"):
            rt.StartContainer(pb.StartContainerRequest(container_id=cid), timeout=120)
        flt = pb.ListContainersRequest(filter=pb.ContainerFilter(pod_sandbox_id=pod))
        for _ in range(repeat):
            with clock(samples, "ContainerStatus"):
                rt.ContainerStatus(pb.ContainerStatusRequest(container_id=cid), timeout=30)
            with clock(samples, "PodSandboxStatus"):
                rt.PodSandboxStatus(pb.PodSandboxStatusRequest(pod_sandbox_id=pod), timeout=30)
            with clock(samples, "ListContainers"):
                rt.ListContainers(flt, timeout=30)
        with clock(samples, "StopContainer"):
            rt.StopContainer(pb.StopContainerRequest(container_id=cid, timeout=APP_STOP_TIMEOUT), timeout=120)
        with clock(samples, "RemoveContainer"):
            rt.RemoveContainer(pb.RemoveContainerRequest(container_id=cid), timeout=120)
        with clock(samples, "StopPodSandbox"):
            rt.StopPodSandbox(pb.StopPodSandboxRequest(pod_sandbox_id=pod), timeout=120)
        with clock(samples, "RemovePodSandbox"):
            rt.RemovePodSandbox(pb.RemovePodSandboxRequest(pod_sandbox_id=pod), timeout=120)
        self.pods.discard(pod)

    def host_network_pod(self, samples: Samples, op: str) -> None:
        """RunPodSandbox of a host-network pod, timed; its stop and remove untimed."""
        sc = self.pod_config()
        sc.linux.security_context.namespace_options.network = pb.NODE
        sc.ClearField("hostname")  # the node's (containerd's runc refuses to set one in the host's UTS)
        sc.dns_config.servers.append("10.96.0.10")
        with clock(samples, op):
            pod = self.run_pod(sc)
        self.rt.StopPodSandbox(pb.StopPodSandboxRequest(pod_sandbox_id=pod), timeout=120)
        self.rt.RemovePodSandbox(pb.RemovePodSandboxRequest(pod_sandbox_id=pod), timeout=120)
        self.pods.discard(pod)

    def start_many(self, count: int, per_pod: int) -> None:
        """`count` running containers, `per_pod` to a pod."""
        made = 0
        while made < count:
            sc = self.pod_config()
            pod = self.run_pod(sc)
            for j in range(min(per_pod, count - made)):
                cid = self.create(pod, sc, f"c{j}")
                self.rt.StartContainer(pb.StartContainerRequest(container_id=cid), timeout=120)
                made += 1

    def running_containers(self) -> int:
        flt = pb.ContainerFilter(state=pb.ContainerStateValue(state=pb.CONTAINER_RUNNING))
        return len(self.rt.ListContainers(pb.ListContainersRequest(filter=flt), timeout=30).containers)

    def cleanup(self) -> None:
        """Remove the pods of this run (RemovePodSandbox takes their containers along)."""
        with contextlib.suppress(grpc.RpcError):
            listed = self.rt.ListPodSandbox(pb.ListPodSandboxRequest(), timeout=30).items
            for p in listed:
                if p.labels.get("cri-shim-bench") == self.run_id:
                    self.pods.add(p.id)
        for pod in sorted(self.pods):
            for call, req in (
                (self.rt.StopPodSandbox, pb.StopPodSandboxRequest(pod_sandbox_id=pod)),
                (self.rt.RemovePodSandbox, pb.RemovePodSandboxRequest(pod_sandbox_id=pod)),
            ):
                try:
                    call(req, timeout=120)
                except grpc.RpcError as exc:
                    print(
                        f"  cleanup {self.name}: {pod[:12]}: {exc.code().name} {exc.details()}",
                        file=sys.stderr,
                    )
        self.pods.clear()

    def close(self) -> None:
        self.channel.close()


# ---------------------------------------------------------------- raw engine


class Raw:
    """The same lifecycle straight through the docker SDK (low-level API client)."""

    def __init__(self, run_id: str) -> None:
        self.api = docker.APIClient(base_url=DOCKER_SOCK, version="auto", timeout=120)
        self.run_id = run_id
        self.seq = 0

    def pull(self) -> None:
        """Pull what is missing (untimed: others share the engine and may remove images)."""
        for image in (PAUSE, BUSYBOX):
            try:
                self.api.inspect_image(image)
            except docker.errors.ImageNotFound:
                repo, tag = image.rsplit(":", 1)
                self.api.pull(repo, tag=tag)

    def lifecycle(self, samples: Samples, repeat: int) -> None:
        api = self.api
        self.seq += 1
        labels = {RAW_LABEL: self.run_id}
        name = f"cri-shim-bench-{self.run_id}-{self.seq}"
        with clock(samples, "RunPodSandbox"):
            pause = api.create_container(
                PAUSE,
                name=f"{name}-pause",
                hostname=f"bench-{self.seq}",
                labels=labels,
                host_config=api.create_host_config(network_mode="bridge", ipc_mode="shareable"),
            )["Id"]
            api.start(pause)
        joined = f"container:{pause}"
        with clock(samples, "CreateContainer"):
            app = api.create_container(
                BUSYBOX,
                command=["sleep", "3600"],
                name=f"{name}-app",
                labels=labels,
                host_config=api.create_host_config(network_mode=joined, ipc_mode=joined),
            )["Id"]
        with clock(samples, "StartContainer"):
            api.start(app)
        for _ in range(repeat):
            with clock(samples, "ContainerStatus"):
                api.inspect_container(app)
            with clock(samples, "PodSandboxStatus"):
                api.inspect_container(pause)
            with clock(samples, "ListContainers"):
                api.containers(all=True, filters={"label": f"{RAW_LABEL}={self.run_id}"})
        with clock(samples, "StopContainer"):
            api.stop(app, timeout=APP_STOP_TIMEOUT)
        with clock(samples, "RemoveContainer"):
            api.remove_container(app, v=True)
        with clock(samples, "StopPodSandbox"):
            api.stop(pause, timeout=PAUSE_STOP_TIMEOUT)
        with clock(samples, "RemovePodSandbox"):
            api.remove_container(pause, v=True)

    def cleanup(self) -> None:
        for row in self.api.containers(all=True, filters={"label": f"{RAW_LABEL}={self.run_id}"}):
            with contextlib.suppress(docker.errors.APIError):
                self.api.remove_container(row["Id"], v=True, force=True)

    def close(self) -> None:
        self.api.close()


# ---------------------------------------------------------------- cri-shim child process


class Shim:
    """`cri-shim serve` with the docker backend, on a temporary socket and state."""

    def __init__(
        self, tmp: str, run_id: str, extra_config: str = "", own_session: bool = False, transport: str = ""
    ) -> None:
        """``extra_config``: more TOML after the docker handler's table (other handlers).
        ``own_session``: out of our process group, so that a Ctrl-C aimed at the benchmark
        leaves the shim up until it has removed what it made. ``transport``: `serve
        --transport` ("": the default).
        """
        self.tmp = tmp
        # The backend labels every engine container with its instance: naming
        # it here lets the cleanup find what the shim left behind if it died.
        self.instance = f"cri-shim-bench-{run_id}"
        self.sock = f"{tmp}/cri-shim.sock"
        self.state_dir = f"{tmp}/state"
        self.config = f"{tmp}/cri-shim.toml"
        with open(self.config, "w") as f:
            f.write(
                "[server]\n"
                f'listen = "unix://{self.sock}"\n'
                f'state_dir = "{self.state_dir}"\n'
                'default_handler = "docker"\n'
                "\n[handlers.docker]\n"
                'type = "docker"\n'
                f'endpoint = "{DOCKER_SOCK}"\n'
                f'pause_image = "{PAUSE}"\n'
                f'instance = "{self.instance}"\n' + extra_config
            )
        self.log = open(f"{tmp}/cri-shim.log", "wb")
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "shim.cli",
                "serve",
                "--config",
                self.config,
                "--default-handler",
                "docker",
                "--log-level",
                "warning",
                *(["--transport", transport] if transport else []),
            ],
            cwd=ROOT,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=own_session,
        )

    def engine_leftovers(self) -> list[str]:
        """Engine containers of this shim instance."""
        from backends.docker import labels as lbl

        api = docker.APIClient(base_url=DOCKER_SOCK, version="auto", timeout=60)
        try:
            rows = api.containers(all=True, filters={"label": f"{lbl.INSTANCE}={self.instance}"})
            return [str(r["Id"]) for r in rows]
        finally:
            api.close()

    def remove_engine_leftovers(self) -> None:
        """Whatever the shim did not remove through CRI (e.g. it died): straight from the engine."""
        with contextlib.suppress(Exception):
            leftovers = self.engine_leftovers()
            if leftovers:
                print(f"removing {len(leftovers)} engine leftovers of cri-shim", file=sys.stderr)
                api = docker.APIClient(base_url=DOCKER_SOCK, version="auto", timeout=60)
                for eid in leftovers:
                    with contextlib.suppress(docker.errors.APIError):
                        api.remove_container(eid, v=True, force=True)
                api.close()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()


def answering(name: str, sock: str, run_id: str, log_dir: str) -> Cri | None:
    """The endpoint on ``sock`` if something answers there; else None, said on stderr."""
    c = Cri(name, sock, run_id, log_dir)
    if c.answers():
        return c
    c.close()
    print(f"nothing answers on unix://{sock}", file=sys.stderr)
    return None


# ---------------------------------------------------------------- images in the test registry

# The registry's repository of the images part: busybox's layer under configs of
# their own, each a distinct image (ListImages counts images, not tags).
REGISTRY = "127.0.0.1:5000"
IMAGES_REPO = "cri-shim-bench-images"
MANIFEST_V2 = "application/vnd.docker.distribution.manifest.v2+json"


def _registry(
    method: str, path: str, body: bytes | None = None, headers: dict[str, str] | None = None
) -> Any:
    req = urllib.request.Request(
        f"http://{REGISTRY}/v2/{path}", data=body, method=method, headers=headers or {}
    )
    return urllib.request.urlopen(req, timeout=30)


def registry_images(count: int) -> list[str]:
    """``count`` distinct images in the test registry: busybox's manifest with a config of
    each one's own (a label numbering it). The blobs are deterministic, so a rerun finds
    them there and pushes nothing."""
    refs = [f"{REGISTRY}/{IMAGES_REPO}:img-{i}" for i in range(count)]
    missing = []
    for i in range(count):
        try:
            _registry("HEAD", f"{IMAGES_REPO}/manifests/img-{i}", headers={"Accept": MANIFEST_V2}).close()
        except urllib.error.HTTPError:
            missing.append(i)
    if not missing:
        return refs
    manifest = json.load(_registry("GET", "busybox/manifests/1.36", headers={"Accept": MANIFEST_V2}))
    config = json.load(_registry("GET", f"busybox/blobs/{manifest['config']['digest']}"))
    for layer in manifest["layers"]:  # mounted from busybox's repository, not uploaded
        _registry("POST", f"{IMAGES_REPO}/blobs/uploads/?mount={layer['digest']}&from=busybox", b"").close()
    for i in missing:
        labels = dict(config["config"].get("Labels") or {})
        labels["io.cri-shim.bench.image"] = str(i)
        blob = json.dumps(
            {**config, "config": {**config["config"], "Labels": labels}}, sort_keys=True
        ).encode()
        digest = "sha256:" + hashlib.sha256(blob).hexdigest()
        upload = _registry("POST", f"{IMAGES_REPO}/blobs/uploads/", b"")
        location = upload.headers["Location"]
        upload.close()
        sep = "&" if "?" in location else "?"
        put = urllib.request.Request(
            f"{location}{sep}digest={digest}",
            data=blob,
            method="PUT",
            headers={"Content-Type": "application/octet-stream"},
        )
        urllib.request.urlopen(put, timeout=30).close()
        body = {
            "schemaVersion": 2,
            "mediaType": MANIFEST_V2,
            "config": {"mediaType": manifest["config"]["mediaType"], "size": len(blob), "digest": digest},
            "layers": manifest["layers"],
        }
        data = json.dumps(body, sort_keys=True).encode()
        _registry("PUT", f"{IMAGES_REPO}/manifests/img-{i}", data, {"Content-Type": MANIFEST_V2}).close()
    return refs


def image_count(c: Cri) -> int:
    return len(c.im.ListImages(pb.ListImagesRequest(), timeout=60).images)


def fill_images(c: Cri, refs: list[str], target: int) -> list[str]:
    """Pull as many of ``refs`` as ``c`` needs to hold ``target`` images (8 pulls at a time)."""
    wanted = refs[: max(0, target - image_count(c))]

    def pull(ref: str) -> None:
        c.im.PullImage(pb.PullImageRequest(image=pb.ImageSpec(image=ref)), timeout=300)

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        list(pool.map(pull, wanted))
    return wanted


def remove_bench_images(c: Cri) -> None:
    """Every image of the bench's repository, also those an interrupted run left."""
    with contextlib.suppress(grpc.RpcError):
        for img in c.im.ListImages(pb.ListImagesRequest(), timeout=60).images:
            if any(t.startswith(f"{REGISTRY}/{IMAGES_REPO}:") for t in img.repo_tags):
                c.im.RemoveImage(pb.RemoveImageRequest(image=pb.ImageSpec(image=img.id)), timeout=120)


def _interrupt(signum: int, frame: object) -> None:
    """SIGTERM: cleaned up as after a Ctrl-C."""
    raise KeyboardInterrupt
