"""Crash rounds: SIGKILL cri-shim in the middle of concurrent lifecycles; is anything lost or leaked?

For one handler (fake, docker or runv) it starts its own ``cri-shim serve``
(own socket, state dir and config under a short /tmp path; runv gets its own
root, run_dir, bridge, subnet, IPAM dir, iptables chain and cgroup parent;
docker its own instance label and pause image 127.0.0.1:5000/pause:3.10), then
runs ``--rounds`` rounds. In each round ``--workers`` threads run pod
lifecycles, ``--ops`` RPCs in all:

    RunPodSandbox (+ PodSandboxStatus for its IP) -> CreateContainer
    (sh -c "echo hi; sleep 3600") -> StartContainer -> ExecSync echo x ->
    StopContainer -> RemoveContainer -> StopPodSandbox -> RemovePodSandbox

A lifecycle stops early at a random step (and a later round may carry it on),
so pods and containers in every state exist when, at a random moment, the
shim is SIGKILLed (by the PID this script started) and restarted with the
same arguments. Once it answers Version and the round's workers are done,
every acknowledged fact is checked with ListPodSandbox, ListContainers,
PodSandboxStatus and ContainerStatus:

- LOST: an acknowledged pod or container missing, or in an earlier state than
  acknowledged (a step whose call died with the shim may or may not have
  happened: later states are fine);
- REVIVED: acknowledged removed, yet listed or found again;
- IP CHANGED: a pod's IP differs from the one PodSandboxStatus acknowledged;
- ERRORS: RPC failures not caused by the kill. UNAVAILABLE, CANCELLED and
  connection errors of calls in flight while the shim was down are expected
  (counted apart); any other failure, and any failure of a call made while the
  shim was up and stable (also the checks and the final cleanup), is an error,
  listed with its code and message.

With ``--cni`` (docker, runv) pods are on a CNI network of the run's own instead of the
engine's or runv's bridge (``pod_network = "cni"``): Debian's loopback + bridge + host-local + portmap
on a bridge ``crr0-<rand>`` and a free /24 of 10.252.0.0/16, host-local's store and
the config under the run's directory; every other pod maps a host port (portmap).

At the end every pod is removed through CRI, the shim is stopped with SIGTERM,
and LEAKED counts what is left: records in the state dir (all handlers);
docker: engine containers with this shim's instance label and the directories of
pods' own hosts / resolv.conf (backends/docker/pod_files.py) (--cni: also the
addresses host-local holds, veths on the bridge, iptables rules and chains of
the network, pinned namespaces, CNI cache entries; runv --cni the same, its pins
counted as mounts under its root); runv: entries of
its run_dir and root/containers, cgroups under its cgroup parent (every v1
hierarchy and v2), processes in them, veths on its bridge, IPAM files, mounts
under its directories, rules in its chain. Then what it made is removed (its
bridge and chain, cgroups, directories), only its own.

It prints one table and exits 0 (a benchmark) unless the harness itself broke.

Run as root from the repository root (docker: the engine's socket; runv:
namespaces, cgroups, bridge), with the registry of scripts/testenv/up:
    .venv/bin/python bench/crash_rounds.py --handler docker|runv [--cni] [--rounds 10] [--ops 40] [--workers 8] [--seed N]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import ipaddress
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import grpc

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from endpoints import BUSYBOX, DOCKER_SOCK, PAUSE, Cri, Raw, Shim, _interrupt, pod_sandbox_config  # noqa: E402

from cri_api import api_pb2 as pb  # noqa: E402
from tests.cni.realnet import Line, Net, cni_iptables  # noqa: E402

RPC_TIMEOUT = 30.0  # every RPC of the workers and the checks
READY_TIMEOUT = 120.0  # a restarted shim must answer Version within this
STEPS = ("run", "create", "start", "exec", "stop_c", "remove_c", "stop_p", "remove_p")
RPC_NAME = {
    "run": "RunPodSandbox",
    "create": "CreateContainer",
    "start": "StartContainer",
    "exec": "ExecSync",
    "stop_c": "StopContainer",
    "remove_c": "RemoveContainer",
    "stop_p": "StopPodSandbox",
    "remove_p": "RemovePodSandbox",
}
# Steps that may be sent again after the shim died under them: the CRI makes them idempotent.
IDEMPOTENT = {"exec", "stop_c", "remove_c", "stop_p", "remove_p"}
# Failure details that are the transport breaking (the kill), whatever the code.
CONN_RE = re.compile(
    r"Socket closed|Connection reset|connection refused|failed to connect|Stream removed|"
    r"Broken pipe|Connection aborted|GOAWAY|Failed to connect|connect\(\)",
    re.IGNORECASE,
)
KILL_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)


@dataclasses.dataclass
class Life:
    """One pod's lifecycle and what the shim acknowledged of it."""

    name: str
    uid: str
    config: pb.PodSandboxConfig
    target: int  # steps to run this time (STEPS[:target])
    pod: str = ""
    ip: str | None = None  # None: not acknowledged (the status call died with the shim)
    cid: str = ""
    done: int = 0  # STEPS[:done] acknowledged, in order
    uncertain: str = ""  # a step whose call died with the shim: it may or may not have happened
    busy: bool = False
    disturbed: bool = False  # an error or a check found it odd: not carried on

    def acked(self, step: str) -> bool:
        return STEPS.index(step) < self.done


class CrashShim(Shim):
    """endpoints.Shim (SIGTERM stop, engine leftovers by instance label) for any handler,
    started again and again with the same arguments, and SIGKILLed by its PID."""

    def __init__(self, tmp: str, run_id: str, handler: str, handler_toml: str) -> None:
        # Not Shim.__init__: its config is docker's only, and it starts the process at once.
        self.tmp = tmp
        self.instance = f"crash-rounds-{run_id}"
        self.sock = f"{tmp}/s.sock"
        self.state_dir = f"{tmp}/state"
        self.config = f"{tmp}/cri-shim.toml"
        with open(self.config, "w") as f:
            f.write(f'[images]\npause_image = "{PAUSE}"\n\n{handler_toml}')
        self.argv = [
            sys.executable,
            "-m",
            "shim.cli",
            "serve",
            "--listen",
            f"unix://{self.sock}",
            "--state-dir",
            self.state_dir,
            "--default-handler",
            handler,
            "--config",
            self.config,
            "--log-level",
            "info",
        ]
        self.log = open(f"{tmp}/cri-shim.log", "ab")
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def start(self) -> None:
        self.starts += 1
        self.log.write(f"===== crash_rounds: start #{self.starts} {time.strftime('%T')}\n".encode())
        self.log.flush()
        # Its own session: a Ctrl-C of the benchmark must leave it up until the pods are removed.
        self.proc = subprocess.Popen(
            self.argv, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True
        )

    def kill(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)
        self.log.write(f"===== crash_rounds: SIGKILL {time.strftime('%T')}\n".encode())
        self.log.flush()


def free_subnet() -> str:
    """A /24 in 10.97-99.x.0 that no route of the host overlaps."""
    out = subprocess.run(["ip", "-4", "route"], capture_output=True, text=True, check=False).stdout
    used = []
    for line in out.splitlines():
        with contextlib.suppress(ValueError):
            used.append(ipaddress.IPv4Network(line.split()[0], strict=False))
    for _ in range(200):
        net = ipaddress.IPv4Network(f"10.{random.choice((97, 98, 99))}.{random.randrange(256)}.0/24")
        if not any(net.overlaps(u) for u in used if u.prefixlen > 0):
            return str(net)
    raise RuntimeError("no free /24 subnet found")


def describe(exc: grpc.RpcError) -> tuple[grpc.StatusCode, str]:
    return exc.code(), exc.details() or ""


class Run:
    """The shim, the bookkeeping and the counters of one benchmark run."""

    def __init__(self, args: argparse.Namespace, tmp: str, run_id: str) -> None:
        self.args = args
        self.handler: str = args.handler
        self.tmp = tmp
        self.run_id = run_id
        self.logs = f"{tmp}/logs"
        os.makedirs(self.logs)
        self.runv: dict[str, Any] = {}
        self.cni: Net | None = None
        self.cni_before: set[Line] = set()
        if self.handler == "runv":
            # Imported here: fake and docker runs need nothing of runv.
            from runv_bench import network_config, runv_config

            net = network_config(tmp, run_id, free_subnet())
            net["bridge"] = f"rvc{run_id}"
            net["hostport_chain"] = f"CRISHIM-CR-{run_id}"
            net["ipam_dir"] = f"{tmp}/runv-ipam"  # {tmp}/ipam is host-local's, with --cni
            self.runv = runv_config(tmp, f"cr-{run_id}", net)
            stub = self.runv["stub"]
            toml = (
                "[handlers.runv]\n"
                'type = "runv"\n'
                + ('pod_network = "cni"\n' if args.cni else "")
                + f'root = "{self.runv["root"]}"\n'
                f'run_dir = "{self.runv["run_dir"]}"\n'
                f"agent_timeout = {self.runv['agent_timeout']}\n"
                "\n[handlers.runv.stub]\n"
                f'cgroup_parent = "{stub["cgroup_parent"]}"\n'
                "\n[handlers.runv.network]\n" + "".join(f'{k} = "{v}"\n' for k, v in net.items())
            )
            if args.warm:
                toml += f"\n[handlers.runv.pool]\nsize = {args.warm}\nmax_cpu = 0\n"
            if args.cni:
                toml += self.cni_network(tmp)
        elif self.handler == "docker":
            toml = (
                "[handlers.docker]\n"
                'type = "docker"\n'
                f'endpoint = "{DOCKER_SOCK}"\n'
                f'pause_image = "{PAUSE}"\n'
                f'instance = "crash-rounds-{run_id}"\n'
            )
            if args.cni:
                toml += 'pod_network = "cni"\n' + self.cni_network(tmp)
            if args.warm:
                toml += f"\n[handlers.docker.pool]\nsize = {args.warm}\nmax_cpu = 0\n"
        else:
            toml = '[handlers.fake]\ntype = "fake"\n'
        toml = f'[server]\ntransport = "{args.transport}"\n\n' + toml
        self.shim = CrashShim(tmp, run_id, self.handler, toml)
        self.lock = threading.Lock()
        self.rng = random.Random(args.seed)
        self.lives: list[Life] = []
        self.seq = 0
        self.client: Cri | None = None
        self.old_clients: list[Cri] = []
        self.gen = 0  # incarnation of the shim
        self.down = False
        self.up = threading.Event()
        # counters
        self.acked_ops = 0
        self.kill_failures: collections.Counter[str] = collections.Counter()
        self.errors: collections.Counter[str] = collections.Counter()
        self.lost: list[str] = []
        self.revived: list[str] = []
        self.ip_changed: list[str] = []
        self.notes: collections.Counter[str] = collections.Counter()
        self.leaked: list[str] = []
        self.restart_times: list[float] = []
        self.shim_died = ""
        self.harness_errors: list[str] = []
        self.dup_ips: dict[str, set[str]] = {}  # an IP seen on several READY pods at once
        # per round
        self.tokens = 0
        self.taken = 0
        self.checked = [0, 0]  # acknowledged pods, containers checked in the last check
        self.ready_pods = 0  # READY pods listed at the last check
        self.phase = ""

    def cni_network(self, tmp: str) -> str:
        """The run's own CNI network, its config written; the ``[cni]`` table that names it."""
        self.cni_before = cni_iptables()
        self.cni = Net(Path(tmp), "crr", 252, gateway=True)
        self.cni.write_conflist()
        return f'\n[cni]\nconf_dir = "{self.cni.conf_dir}"\nbin_dirs = ["/usr/lib/cni"]\n'

    # ------------------------------------------------------------------ shim incarnations
    def boot(self) -> None:
        self.shim.start()
        c = Cri("crash", self.shim.sock, self.run_id, self.logs)
        try:
            c.wait_ready(READY_TIMEOUT)
        except grpc.RpcError:
            c.close()
            raise
        with self.lock:
            if self.client is not None:
                self.old_clients.append(self.client)
            self.client = c
            self.down = False
        self.up.set()

    def kill_and_restart(self) -> None:
        with self.lock:
            self.down = True
            self.gen += 1
            self.up.clear()
        self.shim.kill()
        self.phase = "after restart"
        t0 = time.monotonic()
        try:
            self.boot()
        except grpc.RpcError as exc:
            self.shim_died = f"no answer to Version {READY_TIMEOUT:.0f} s after restart: {exc.code().name}"
            raise
        self.restart_times.append(time.monotonic() - t0)

    @property
    def rt(self) -> Any:
        assert self.client is not None
        return self.client.rt

    # ------------------------------------------------------------------ bookkeeping
    def error(self, where: str, code: grpc.StatusCode | str, details: str) -> None:
        name = code.name if isinstance(code, grpc.StatusCode) else code
        with self.lock:
            self.errors[f"{where}: {name}: {details!r}"] += 1

    def take_token(self) -> bool:
        with self.lock:
            if self.taken >= self.tokens:
                return False
            self.taken += 1
            return True

    def next_life(self, worker: int) -> Life:
        with self.lock:
            carry = [
                lf
                for lf in self.lives
                if not lf.busy
                and not lf.disturbed
                and (not lf.uncertain or lf.uncertain in IDEMPOTENT)
                and 0 < lf.done < len(STEPS)
            ]
            # Pods not stopped yet (runv: VMs holding node capacity), including unresolved ones.
            live = sum(
                1
                for lf in self.lives
                if (lf.pod and not lf.acked("stop_p")) or (lf.uncertain == "run" and not lf.pod)
            )
            if carry and live >= self.args.max_live:
                # Enough pods about: carry one on, at least through StopPodSandbox.
                ready = [lf for lf in carry if not lf.acked("stop_p")] or carry
                life = self.rng.choice(ready)
                life.target = self.rng.randint(max(life.done + 1, STEPS.index("stop_p") + 1), len(STEPS))
            elif carry and self.rng.random() < 0.3:
                life = self.rng.choice(carry)
                life.target = self.rng.randint(life.done + 1, len(STEPS))
            else:
                self.seq += 1
                name = f"cr-{self.run_id}-{self.seq}"
                config = pod_sandbox_config(
                    name,
                    f"crash-rounds-{self.run_id}",
                    f"{self.run_id}-{self.seq}",
                    os.path.join(self.logs, name),
                    {"crash-rounds": self.run_id},
                )
                if self.cni is not None and self.seq % 2:
                    # portmap's rules for it, to be removed with it.
                    config.port_mappings.add(container_port=80, host_port=40000 + self.seq % 20000)
                if self.handler == "docker" and self.args.warm and self.seq % 2:
                    # Every other pod shares the host's network, as a kubelet asks for it: the
                    # pods that warm pause containers serve.
                    sc = config.linux.security_context
                    sc.namespace_options.network = pb.NODE
                    sc.seccomp.profile_type = pb.SecurityProfile.RuntimeDefault
                    config.ClearField("hostname")
                # Whole lifecycles weigh more: every step gets exercised, and pods are removed too.
                target = self.rng.choice((1, 2, 3, 4, 5, 6, 7, 8, 8, 8))
                life = Life(name, f"{self.run_id}-{self.seq}", config, target)
                self.lives.append(life)
            life.busy = True
            return life

    # ------------------------------------------------------------------ one step
    def call(self, step: str, life: Life) -> str:
        """ "ok", "kill" (failed because the shim died under it) or "error"."""
        if not self.up.wait(READY_TIMEOUT):
            return "kill"
        with self.lock:
            gen0, down0 = self.gen, self.down
            assert self.client is not None
            rt = self.client.rt
        try:
            self._do(rt, step, life)
            with self.lock:
                self.acked_ops += 1
            return "ok"
        except grpc.RpcError as exc:
            code, details = describe(exc)
            with self.lock:
                overlapped = down0 or self.down or self.gen != gen0
                phase = "during kill" if overlapped else self.phase
            if overlapped and (code in KILL_CODES or CONN_RE.search(details)):
                with self.lock:
                    self.kill_failures[f"{RPC_NAME[step]}: {code.name}: {details!r}"] += 1
                return "kill"
            self.error(f"{RPC_NAME[step]} ({phase})", code, details)
            return "error"
        except _BadResult as exc:
            self.error(f"{RPC_NAME[step]} ({self.phase})", "BAD RESULT", str(exc))
            return "error"

    def _do(self, rt: Any, step: str, life: Life) -> None:
        t = RPC_TIMEOUT
        if step == "run":
            req = pb.RunPodSandboxRequest(config=life.config, runtime_handler=self.handler)
            # Acknowledged once it returns, even if the status call for its IP fails.
            life.pod = str(rt.RunPodSandbox(req, timeout=t).pod_sandbox_id)
            st = rt.PodSandboxStatus(pb.PodSandboxStatusRequest(pod_sandbox_id=life.pod), timeout=t)
            life.ip = st.status.network.ip
        elif step == "create":
            cc = pb.ContainerConfig(
                metadata=pb.ContainerMetadata(name="app"),
                image=pb.ImageSpec(image=BUSYBOX),
                command=["sh", "-c", "echo hi; sleep 3600"],
                log_path="app.log",
                labels={"crash-rounds": self.run_id},
            )
            req = pb.CreateContainerRequest(pod_sandbox_id=life.pod, config=cc, sandbox_config=life.config)
            life.cid = str(rt.CreateContainer(req, timeout=t).container_id)
        elif step == "start":
            rt.StartContainer(pb.StartContainerRequest(container_id=life.cid), timeout=t)
        elif step == "exec":
            r = rt.ExecSync(
                pb.ExecSyncRequest(container_id=life.cid, cmd=["echo", "x"], timeout=10), timeout=t
            )
            if r.exit_code != 0 or r.stdout != b"x\n":
                raise _BadResult(f"exit {r.exit_code}, stdout {r.stdout!r}, stderr {r.stderr!r}")
        elif step == "stop_c":
            rt.StopContainer(pb.StopContainerRequest(container_id=life.cid, timeout=0), timeout=t)
        elif step == "remove_c":
            rt.RemoveContainer(pb.RemoveContainerRequest(container_id=life.cid), timeout=t)
        elif step == "stop_p":
            rt.StopPodSandbox(pb.StopPodSandboxRequest(pod_sandbox_id=life.pod), timeout=t)
        elif step == "remove_p":
            rt.RemovePodSandbox(pb.RemovePodSandboxRequest(pod_sandbox_id=life.pod), timeout=t)

    def worker(self, i: int) -> None:
        while True:
            life = self.next_life(i)
            try:
                while life.done < life.target:
                    step = STEPS[life.done]
                    if not self.take_token():
                        return
                    out = self.call(step, life)
                    if out == "ok":
                        life.done += 1
                        life.uncertain = ""
                    elif out == "kill":
                        if step == "run" and life.pod:
                            life.done = 1  # created; only its IP is unknown
                            life.ip = None
                            break
                        life.uncertain = step
                        if step not in IDEMPOTENT:
                            break  # its outcome is unknown: leave it as it is
                        # else: send it again once the shim is back
                    else:
                        if step == "run" and life.pod:
                            life.done = 1
                        life.disturbed = True
                        break
            except Exception as exc:
                with self.lock:
                    self.harness_errors.append(f"worker {i}: {type(exc).__name__}: {exc}")
                return
            finally:
                with self.lock:
                    life.busy = False

    # ------------------------------------------------------------------ one round
    def round(self, n: int) -> None:
        self.tokens = self.args.ops
        self.taken = 0
        self.phase = "before kill"
        kill_at = self.rng.randint(1, max(1, self.args.ops * 3 // 4))
        delay = self.rng.uniform(0, 0.03)  # calls last 1-1500 ms: most kills land mid-call
        t0 = time.monotonic()
        threads = [
            threading.Thread(target=self.worker, args=(i,), daemon=True) for i in range(self.args.workers)
        ]
        for t in threads:
            t.start()
        while self.taken < kill_at and any(t.is_alive() for t in threads):
            time.sleep(0.002)
        time.sleep(delay)
        killed_at = self.taken
        self.kill_and_restart()
        for t in threads:
            t.join(READY_TIMEOUT + 4 * RPC_TIMEOUT)
            if t.is_alive():
                raise RuntimeError("a worker did not finish in time")
        took = time.monotonic() - t0
        self.phase = "check"
        before = (len(self.lost), len(self.revived), len(self.ip_changed), sum(self.errors.values()))
        self.check()
        after = (len(self.lost), len(self.revived), len(self.ip_changed), sum(self.errors.values()))
        delta = [a - b for a, b in zip(after, before, strict=True)]
        for c in self.old_clients:
            c.close()
        self.old_clients.clear()
        print(
            f"round {n}: {self.taken} RPCs in {took:.1f} s, SIGKILL after RPC {killed_at} (+{delay * 1000:.0f} ms), "
            f"back in {self.restart_times[-1]:.1f} s; {self.ready_pods} pods READY; checked {self.checked[0]} pods, {self.checked[1]} containers: new lost {delta[0]}, revived {delta[1]}, "
            f"IP changed {delta[2]}, errors {delta[3]}",
            file=sys.stderr,
            flush=True,
        )

    # ------------------------------------------------------------------ the checks
    def check(self) -> None:
        """Every acknowledged fact against what the restarted shim reports."""
        rt, t = self.rt, RPC_TIMEOUT
        try:
            pods = {p.id: p for p in rt.ListPodSandbox(pb.ListPodSandboxRequest(), timeout=t).items}
            ctrs = {c.id: c for c in rt.ListContainers(pb.ListContainersRequest(), timeout=t).containers}
        except grpc.RpcError as exc:
            self.error("List (check)", *describe(exc))
            return
        known_pods = {lf.pod for lf in self.lives if lf.pod}
        known_ctrs = {lf.cid for lf in self.lives if lf.cid}
        ready_ips: dict[str, list[str]] = collections.defaultdict(list)
        self.checked = [0, 0]
        for lf in self.lives:
            if not lf.pod:
                continue
            self.checked[0] += 1
            self.checked[1] += bool(lf.cid)
            tag = f"{lf.name} pod {lf.pod[:12]}"
            # ---- the pod
            if lf.acked("remove_p"):
                if lf.pod in pods:
                    self.revived.append(f"{tag}: removed (acknowledged) but listed again")
                self._expect_not_found("PodSandboxStatus", lf.pod, tag)
            else:
                st = self._status_pod(lf.pod, tag)
                if st is None:
                    if lf.uncertain != "remove_p":
                        self.lost.append(f"{tag}: acknowledged (done: {STEPS[lf.done - 1]}) but not found")
                        lf.disturbed = True
                    elif lf.pod in pods:
                        self.notes["pod listed but its status NOT_FOUND"] += 1
                else:
                    state = st.status.state
                    if lf.pod not in pods and lf.uncertain != "remove_p":
                        self.lost.append(f"{tag}: PodSandboxStatus finds it, ListPodSandbox does not")
                    if lf.acked("stop_p") and state == pb.SANDBOX_READY:
                        self.lost.append(f"{tag}: stop acknowledged, reported READY again")
                    if state == pb.SANDBOX_NOTREADY and not lf.acked("stop_p") and lf.uncertain != "stop_p":
                        self.notes["pod NOTREADY without a stop sent"] += 1
                        lf.disturbed = True
                    ip = st.status.network.ip
                    if lf.ip is not None and ip != lf.ip:
                        self.ip_changed.append(f"{tag}: acknowledged IP {lf.ip!r}, now {ip!r}")
                        lf.ip = ip
                    if state == pb.SANDBOX_READY and ip:
                        ready_ips[ip].append(lf.pod[:12])
            # ---- its container
            if not lf.cid:
                continue
            ctag = f"{lf.name} container {lf.cid[:12]}"
            gone_acked = lf.acked("remove_c") or lf.acked("remove_p")
            if gone_acked:
                if lf.cid in ctrs:
                    self.revived.append(f"{ctag}: removed (acknowledged) but listed again")
                self._expect_not_found("ContainerStatus", lf.cid, ctag)
                continue
            cs = self._status_container(lf.cid, ctag)
            if cs is None:
                if lf.uncertain not in ("remove_c", "remove_p"):
                    self.lost.append(f"{ctag}: acknowledged (done: {STEPS[lf.done - 1]}) but not found")
                    lf.disturbed = True
                continue
            state = cs.status.state
            if lf.cid not in ctrs and lf.uncertain not in ("remove_c", "remove_p"):
                self.lost.append(f"{ctag}: ContainerStatus finds it, ListContainers does not")
            name = pb.ContainerState.Name(state)
            if lf.acked("start") and state == pb.CONTAINER_CREATED:
                self.lost.append(f"{ctag}: start acknowledged, reported CREATED")
            if (lf.acked("stop_c") or lf.acked("stop_p")) and state != pb.CONTAINER_EXITED:
                self.lost.append(f"{ctag}: stop acknowledged, reported {name}")
            if state == pb.CONTAINER_UNKNOWN:
                self.notes[f"container UNKNOWN: {cs.status.reason} {cs.status.message}"] += 1
                lf.disturbed = True
            stop_sent = any(lf.acked(s) or lf.uncertain == s for s in ("stop_c", "stop_p", "remove_p"))
            if state == pb.CONTAINER_EXITED and not stop_sent:
                self.notes[
                    f"container EXITED without a stop sent: exit {cs.status.exit_code} "
                    f"reason {cs.status.reason!r} {cs.status.message!r}"
                ] += 1
                lf.disturbed = True
        for ip, holders in ready_ips.items():
            if len(holders) > 1:
                self.dup_ips.setdefault(ip, set()).update(holders)
        self.resolve(pods, ctrs)
        self.ready_pods = sum(1 for p in pods.values() if p.state == pb.SANDBOX_READY)
        known_pods = {lf.pod for lf in self.lives if lf.pod}
        known_ctrs = {lf.cid for lf in self.lives if lf.cid}
        orphans_p = [p for p in pods if p not in known_pods]
        orphans_c = [c for c in ctrs if c not in known_ctrs]
        self.notes["(last check) pods listed never acknowledged (a RunPodSandbox died with the shim)"] = len(
            orphans_p
        )
        self.notes["(last check) containers listed never acknowledged"] = len(orphans_c)

    def resolve(self, pods: dict[str, Any], ctrs: dict[str, Any]) -> None:
        """Steps whose call died with the shim: what the restarted shim reports settles them."""
        by_name = {p.metadata.name: p.id for p in pods.values()}
        for lf in self.lives:
            if lf.busy or lf.uncertain not in ("run", "create", "start"):
                continue
            step, lf.uncertain = lf.uncertain, ""
            rpc = RPC_NAME[step]
            if step == "run":
                if lf.name in by_name:
                    lf.pod, lf.done, lf.ip = by_name[lf.name], 1, None
                    self.notes[f"{rpc} died with the shim; the pod exists afterwards"] += 1
                else:
                    lf.disturbed = True  # nothing to carry on
                    self.notes[f"{rpc} died with the shim; no pod afterwards"] += 1
            elif step == "create":
                found = [
                    c.id for c in ctrs.values() if c.pod_sandbox_id == lf.pod and c.metadata.name == "app"
                ]
                if found:
                    lf.cid, lf.done = found[0], 2
                    state = pb.ContainerState.Name(ctrs[found[0]].state)
                    self.notes[f"{rpc} died with the shim; the container exists afterwards, {state}"] += 1
                else:
                    self.notes[f"{rpc} died with the shim; no container afterwards"] += 1
            else:
                cs = self._status_container(lf.cid, lf.name)
                if cs is None:
                    lf.disturbed = True
                    continue
                state = cs.status.state
                if state in (pb.CONTAINER_RUNNING, pb.CONTAINER_EXITED):
                    lf.done = 3
                if state != pb.CONTAINER_RUNNING:
                    lf.disturbed = state != pb.CONTAINER_CREATED
                reason = f" ({cs.status.reason} {cs.status.message!r})" if cs.status.reason else ""
                self.notes[
                    f"{rpc} died with the shim; afterwards {pb.ContainerState.Name(state)}{reason}"
                ] += 1

    def _status_pod(self, pod: str, tag: str) -> Any:
        try:
            return self.rt.PodSandboxStatus(
                pb.PodSandboxStatusRequest(pod_sandbox_id=pod), timeout=RPC_TIMEOUT
            )
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.NOT_FOUND:
                self.error("PodSandboxStatus (check)", *describe(exc))
            return None

    def _status_container(self, cid: str, tag: str) -> Any:
        try:
            return self.rt.ContainerStatus(pb.ContainerStatusRequest(container_id=cid), timeout=RPC_TIMEOUT)
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.NOT_FOUND:
                self.error("ContainerStatus (check)", *describe(exc))
            return None

    def _expect_not_found(self, rpc: str, ident: str, tag: str) -> None:
        try:
            if rpc == "PodSandboxStatus":
                self.rt.PodSandboxStatus(
                    pb.PodSandboxStatusRequest(pod_sandbox_id=ident), timeout=RPC_TIMEOUT
                )
            else:
                self.rt.ContainerStatus(pb.ContainerStatusRequest(container_id=ident), timeout=RPC_TIMEOUT)
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.NOT_FOUND:
                self.error(f"{rpc} (check)", *describe(exc))
            return
        self.revived.append(f"{tag}: removed (acknowledged) but {rpc} answers")

    # ------------------------------------------------------------------ the end
    def remove_all(self) -> None:
        """Every pod through CRI (stop, remove), then nothing may be listed."""
        rt, t = self.rt, RPC_TIMEOUT
        try:
            pods = [p.id for p in rt.ListPodSandbox(pb.ListPodSandboxRequest(), timeout=t).items]
        except grpc.RpcError as exc:
            self.error("ListPodSandbox (final cleanup)", *describe(exc))
            return
        for pod in pods:
            for rpc, call, req in (
                ("StopPodSandbox", rt.StopPodSandbox, pb.StopPodSandboxRequest(pod_sandbox_id=pod)),
                ("RemovePodSandbox", rt.RemovePodSandbox, pb.RemovePodSandboxRequest(pod_sandbox_id=pod)),
            ):
                try:
                    call(req, timeout=t)
                except grpc.RpcError as exc:
                    self.error(f"{rpc} (final cleanup)", *describe(exc))
        try:
            left_p = rt.ListPodSandbox(pb.ListPodSandboxRequest(), timeout=t).items
            left_c = rt.ListContainers(pb.ListContainersRequest(), timeout=t).containers
        except grpc.RpcError as exc:
            self.error("List (final cleanup)", *describe(exc))
            return
        self.leaked += [f"pod still listed after removal: {p.id[:12]} {p.metadata.name}" for p in left_p]
        self.leaked += [f"container still listed after removal: {c.id[:12]}" for c in left_c]

    def stop_shim(self) -> None:
        for c in [*self.old_clients, *([self.client] if self.client else [])]:
            c.close()
        self.old_clients.clear()
        self.client = None
        proc = self.shim.proc
        self.shim.stop()
        if proc is not None and proc.returncode not in (0, None):
            self.notes[f"shim exit status after SIGTERM: {proc.returncode}"] += 1

    def count_leaks(self) -> None:
        for kind in ("sandboxes", "containers"):
            d = os.path.join(self.shim.state_dir, kind)
            with contextlib.suppress(FileNotFoundError):
                self.leaked += [f"state record {d}/{f}" for f in sorted(os.listdir(d))]
        if self.handler == "docker":
            with contextlib.suppress(Exception):
                self.leaked += [
                    f"engine container {e[:12]} (instance label)" for e in self.shim.engine_leftovers()
                ]
            files = os.path.join(self.shim.state_dir, "backends", "docker", "pod-files")
            with contextlib.suppress(FileNotFoundError):
                self.leaked += [f"pod files {files}/{d}" for d in sorted(os.listdir(files))]
        if self.handler == "runv":
            self.leaked += runv_leftovers(self.runv)
        if self.cni is not None:
            self.leaked += self.cni.leftovers(self.shim.state_dir)

    def cleanup(self) -> None:
        if self.handler == "docker":
            self.shim.remove_engine_leftovers()
        if self.cni is not None:
            for mnt in mounts_under(self.shim.state_dir):
                subprocess.run(["umount", "-l", mnt], capture_output=True, check=False)
            self.cni.cleanup(self.cni_before)
        if self.handler == "runv":
            for mnt in reversed(our_mounts(self.runv)):
                subprocess.run(["umount", "-l", mnt], capture_output=True, check=False)
            from runv_bench import remove_leftovers

            remove_leftovers([self.runv])
            for d in (self.runv["root"], self.runv["network"]["ipam_dir"]):
                shutil.rmtree(d, ignore_errors=True)


class _BadResult(Exception):
    pass


# ---------------------------------------------------------------- leftovers


def mounts_under(*dirs: str) -> list[str]:
    roots = tuple(d.rstrip("/") + "/" for d in dirs)
    out = []
    with open("/proc/self/mountinfo") as fh:
        for line in fh:
            mnt = line.split()[4]
            if mnt.startswith(roots):
                out.append(mnt)
    return out


def our_mounts(cfg: dict[str, Any]) -> list[str]:
    return mounts_under(cfg["run_dir"], cfg["root"])


def runv_leftovers(cfg: dict[str, Any]) -> list[str]:
    out: list[str] = []
    run_dir, root = cfg["run_dir"], cfg["root"]
    with contextlib.suppress(FileNotFoundError):
        out += [f"run_dir entry {run_dir}/{e}" for e in sorted(os.listdir(run_dir))]
    cdir = os.path.join(root, "containers")
    with contextlib.suppress(FileNotFoundError):
        out += [f"container dir {cdir}/{e}" for e in sorted(os.listdir(cdir))]
    from backends.linux.cgroups import Cgroup

    cg = Cgroup(cfg["stub"]["cgroup_parent"])
    dirs = cg.all_dirs()
    v2 = os.path.join("/sys/fs/cgroup/unified", cg.rel)
    if not cg.v2 and v2 not in dirs:
        dirs.append(v2)
    for d in dirs:
        for base, subs, _files in os.walk(d):
            out += [f"cgroup {os.path.join(base, s)}" for s in subs]
    for pid in sorted(set(cg.pids())):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                cmd = fh.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            cmd = "?"
        out.append(f"process {pid} in {cg.rel}: {cmd[:100]}")
    net = cfg["network"]
    brif = f"/sys/class/net/{net['bridge']}/brif"
    with contextlib.suppress(FileNotFoundError):
        for e in sorted(os.listdir(brif)):
            # "rvX@rpY": the peer is still in the host's namespace (never moved into a VM);
            # "rvX@ifN": it is in another namespace.
            show = subprocess.run(["ip", "-o", "link", "show", "dev", e], capture_output=True, text=True)
            pair = show.stdout.split(":")[1].strip() if show.stdout.count(":") > 1 else e
            out.append(f"veth {pair} on {net['bridge']}")
    with contextlib.suppress(FileNotFoundError):
        out += [f"IPAM file {net['ipam_dir']}/{e}" for e in sorted(os.listdir(net["ipam_dir"]))]
    out += [f"mount {m}" for m in our_mounts(cfg)]
    rules = subprocess.run(
        ["iptables", "-t", "nat", "-S", net["hostport_chain"]], capture_output=True, text=True, check=False
    ).stdout
    out += [f"iptables rule {r}" for r in rules.splitlines() if r.startswith("-A ")]
    return out


# ---------------------------------------------------------------- report


def shim_log_problems(path: str, limit: int = 12) -> list[str]:
    """Distinct error/warning/traceback lines of the shim's log (timestamps cut)."""
    seen: collections.Counter[str] = collections.Counter()
    with contextlib.suppress(OSError), open(path, errors="replace") as fh:
        for line in fh:
            low = line.lower()
            if "[error" in low or "[warning" in low or "[critical" in low or "traceback" in low:
                key = re.sub(r"^\S+ ", "", line.strip())[:240]
                seen[key] += 1
    return [f"x{n} {k}" for k, n in seen.most_common(limit)]


def report(run: Run, wall: float, log_path: str) -> None:
    errors = sum(run.errors.values())
    cols = [
        ("handler", run.handler),
        ("rounds", str(run.args.rounds)),
        ("acked ops", str(run.acked_ops)),
        ("lost", str(len(run.lost))),
        ("revived", str(len(run.revived))),
        ("leaked", str(len(run.leaked))),
        ("IP changed", str(len(run.ip_changed))),
        ("errors", str(errors)),
        ("wall s", f"{wall:.0f}"),
    ]
    print()
    print(" | ".join(f"{k:>{max(len(k), len(v))}}" for k, v in cols))
    print("-+-".join("-" * max(len(k), len(v)) for k, v in cols))
    print(" | ".join(f"{v:>{max(len(k), len(v))}}" for k, v in cols))
    rs = sorted(run.restart_times)
    if rs:
        print(
            f"\nrestarts: {len(rs)}, back (answering Version) in median {rs[len(rs) // 2]:.1f} s, max {rs[-1]:.1f} s; "
            f"{sum(run.kill_failures.values())} calls failed because the shim was killed under them (expected)"
        )
    if run.shim_died:
        print(f"SHIM DID NOT COME BACK: {run.shim_died}")
    for h in run.harness_errors:
        print(f"HARNESS: {h}")
    for title, items in (
        ("LOST", run.lost),
        ("REVIVED", run.revived),
        ("IP CHANGED", run.ip_changed),
        ("LEAKED", run.leaked),
    ):
        if items:
            print(f"\n{title}:")
            for x in items[:40]:
                print(f"  {x}")
            if len(items) > 40:
                print(f"  ... {len(items) - 40} more")
    if run.errors:
        print("\nERRORS (RPC: code: message, count):")
        for k, n in run.errors.most_common():
            print(f"  x{n} {k}")
    notes = [(k, n) for k, n in run.notes.items() if n]
    notes += [
        (f"one IP on {len(h)} READY pods at once: {ip} ({', '.join(sorted(h))})", 1)
        for ip, h in run.dup_ips.items()
    ]
    if notes:
        print("\nnotes (not counted above):")
        for k, n in notes:
            print(f"  x{n} {k}")
    if run.kill_failures:
        print("\nfailures caused by the kill (expected):")
        for k, n in run.kill_failures.most_common(8):
            print(f"  x{n} {k}")
    problems = shim_log_problems(log_path)
    if problems:
        print(f"\nshim log {log_path}, distinct warning/error lines:")
        for p in problems:
            print(f"  {p}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--handler", choices=("fake", "docker", "runv"), default="fake")
    ap.add_argument("--rounds", type=int, default=10, help="kill + restart rounds (10)")
    ap.add_argument("--ops", type=int, default=40, help="lifecycle RPCs per round, all workers (40)")
    ap.add_argument("--workers", type=int, default=8, help="concurrent lifecycle workers (8)")
    ap.add_argument("--seed", type=int, default=None, help="random seed (steps, kill moments)")
    ap.add_argument(
        "--max-live",
        type=int,
        default=16,
        help="pods not yet stopped beyond which lifecycles are carried on rather than begun (16; runv's "
        "node capacity is 64 vCPU per host CPU, 1 a pod)",
    )
    ap.add_argument("--keep-tmp", action="store_true", help="keep the whole temp dir, not only the shim log")
    ap.add_argument(
        "--warm",
        type=int,
        default=0,
        help="runv: warm VMs; docker: warm pause containers, and every other pod on the host network (0: off)",
    )
    ap.add_argument(
        "--transport",
        choices=("grpcio", "native"),
        default="grpcio",
        help="how the shim serves the CRI socket ([server] transport; grpcio)",
    )
    ap.add_argument(
        "--cni",
        action="store_true",
        help="docker, runv: pods on a CNI network of the run's own (bridge + host-local + portmap)",
    )
    args = ap.parse_args()
    if args.cni and args.handler == "fake":
        ap.error("--cni is for --handler docker or runv")
    if args.seed is None:
        args.seed = random.randrange(1 << 30)
    if args.handler != "fake" and os.geteuid() != 0:
        print("run as root (the engine's socket; runv: namespaces, cgroups, bridge)", file=sys.stderr)
        return 2
    random.seed(args.seed)
    run_id = uuid.uuid4().hex[:8]
    tmp = tempfile.mkdtemp(prefix="crr-", dir="/tmp")
    signal.signal(signal.SIGTERM, _interrupt)
    run = Run(args, tmp, run_id)
    print(
        f"run {run_id}: handler {args.handler} ({args.transport}), {args.rounds} rounds x {args.ops} RPCs, "
        f"{args.workers} workers, seed {args.seed}, dir {tmp}",
        file=sys.stderr,
        flush=True,
    )
    broke = False
    t0 = time.monotonic()
    try:
        try:
            run.boot()
        except grpc.RpcError:
            print(f"cri-shim did not answer; its log: {tmp}/cri-shim.log", file=sys.stderr)
            raise
        if args.handler == "docker":
            Raw(run_id).pull()  # both images in the engine (the pause image is pulled through it)
        spec = pb.ImageSpec(image=BUSYBOX, runtime_handler=args.handler)
        assert run.client is not None
        im = run.client.im
        if not im.ImageStatus(pb.ImageStatusRequest(image=spec), timeout=60).HasField("image"):
            im.PullImage(pb.PullImageRequest(image=spec), timeout=300)
        for n in range(1, args.rounds + 1):
            try:
                run.round(n)
            except grpc.RpcError:
                if run.shim_died:
                    break
                raise
    except KeyboardInterrupt:
        broke = True
        print("interrupted; cleaning up", file=sys.stderr)
    except Exception:
        broke = True
        import traceback

        traceback.print_exc()
    finally:
        if run.client is not None and not run.shim_died:
            run.remove_all()
        run.stop_shim()
        run.count_leaks()
        run.cleanup()
        wall = time.monotonic() - t0
        log_path = f"{tmp}/cri-shim.log"
        report(run, wall, log_path)
        if args.keep_tmp:
            print(f"\nkept {tmp}")
        else:
            for entry in os.listdir(tmp):
                if entry != "cri-shim.log":
                    p = os.path.join(tmp, entry)
                    if os.path.isdir(p) and not os.path.islink(p):
                        shutil.rmtree(p, ignore_errors=True)
                    else:
                        with contextlib.suppress(OSError):
                            os.unlink(p)
            print(f"\nshim log kept: {log_path}")
    return 1 if broke or run.harness_errors else 0


if __name__ == "__main__":
    sys.exit(main())
