"""What the scenarios run on the cluster: manifests, namespaces, waits on pods, and the kubectl
sessions that stream (logs -f, attach, port-forward, exec with a TTY)."""

from __future__ import annotations

import contextlib
import os
import pty
import re
import secrets
import select
import subprocess
import time
from collections.abc import Iterator
from typing import Any

from tests.e2e.cluster.kubectl import Kubectl, wait_for
from tests.e2e.cluster.layout import NodeSpec


# ------------------------------------------------------------ manifests
def container(name: str, image: str, *command: str, **extra: Any) -> dict[str, Any]:
    c: dict[str, Any] = {"name": name, "image": image, "imagePullPolicy": "IfNotPresent"}
    if command:
        c["command"] = list(command)
    c.update(extra)
    return c


def pod(
    name: str,
    *containers: dict[str, Any],
    on: NodeSpec | None = None,
    labels: dict[str, str] | None = None,
    **spec: Any,
) -> dict[str, Any]:
    """A pod; `on` pins it to a node by the node's handler label (on the runv node: of RuntimeClass
    runv too, whose overhead pays for the VM beyond the containers' limits)."""
    body: dict[str, Any] = {"containers": list(containers), "terminationGracePeriodSeconds": 2, **spec}
    if on is not None:
        body["nodeSelector"] = dict(on.labels)
        if on.runtime == "cri-shim" and on.handler == "runv":
            body.setdefault("runtimeClassName", "runv")
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": labels or {"app": name}},
        "spec": body,
    }


def deployment(name: str, replicas: int, template: dict[str, Any]) -> dict[str, Any]:
    labels = template["metadata"]["labels"]
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": labels},
            "template": {"metadata": template["metadata"], "spec": template["spec"]},
        },
    }


def service(name: str, selector: dict[str, str], port: int, target: int, node_port: bool) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name},
        "spec": {
            "type": "NodePort" if node_port else "ClusterIP",
            "selector": selector,
            "ports": [{"port": port, "targetPort": target, "protocol": "TCP"}],
        },
    }


def netexec(name: str, image: str, on: NodeSpec, **extra: Any) -> dict[str, Any]:
    """agnhost's HTTP server on 8080 (/hostname answers the pod's name), ready once it answers (in a
    VM under TCG it listens seconds after its container started)."""
    ready = {"httpGet": {"path": "/hostname", "port": 8080}, "periodSeconds": 1}
    c = container("web", image, "/agnhost", "netexec", "--http-port=8080", readinessProbe=ready, **extra)
    return pod(name, c, on=on)


# ------------------------------------------------------------ namespaces and pods
def new_namespace(k: Kubectl, prefix: str) -> str:
    name = f"{prefix[:40].lower().replace('_', '-').strip('-')}-{secrets.token_hex(3)}"
    k.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})
    # Pods are refused until the controller-manager made the namespace's ServiceAccount.
    wait_for(f"ServiceAccount default in {name}", lambda: k.get("serviceaccount", "default", name), 60)
    return name


def describe(p: dict[str, Any] | None) -> str:
    """A pod's phase, node and each container's state, in one line."""
    if p is None:
        return "no such pod"
    st = p.get("status", {})
    parts = [f"phase={st.get('phase')}", f"node={p.get('spec', {}).get('nodeName')}"]
    for c in (st.get("initContainerStatuses") or []) + (st.get("containerStatuses") or []):
        state = c.get("state", {})
        (kind, detail), *_ = state.items() if state else [("?", {})]
        reason = detail.get("reason", "") if isinstance(detail, dict) else ""
        message = (detail.get("message", "") if isinstance(detail, dict) else "")[:200]
        parts.append(f"{c['name']}:{kind}:{reason}:{message} restarts={c.get('restartCount')}")
    for cond in st.get("conditions") or []:
        if cond.get("status") != "True" and cond.get("message"):
            parts.append(f"{cond['type']}: {cond['message'][:200]}")
    return " ".join(parts)


def ready(p: dict[str, Any] | None) -> bool:
    if p is None or p.get("status", {}).get("phase") != "Running":
        return False
    return all(c.get("ready") for c in p["status"].get("containerStatuses") or [{}])


def wait_pod(k: Kubectl, ns: str, name: str, pred: Any = ready, timeout: float = 240) -> dict[str, Any]:
    """Wait until `pred(pod)`; on a timeout the error says where the pod stands and its events."""
    last: dict[str, Any] = {}

    def probe() -> dict[str, Any] | None:
        p = k.get("pod", name, ns)
        last["pod"] = p
        return p if p is not None and pred(p) else None

    try:
        return wait_for(f"pod {ns}/{name}", probe, timeout)
    except TimeoutError as exc:
        events = k.run(
            "get", "events", "-n", ns, "--field-selector", f"involvedObject.name={name}", check=False
        )
        raise TimeoutError(f"{exc}\n{describe(last.get('pod'))}\n{events.stdout[-1500:]}") from None


def pods_of(k: Kubectl, ns: str, selector: str) -> list[dict[str, Any]]:
    return list(k.json("get", "pods", "-n", ns, "-l", selector)["items"])


def container_status(p: dict[str, Any], name: str) -> dict[str, Any]:
    for c in (p.get("status", {}).get("containerStatuses") or []) + (
        p.get("status", {}).get("ephemeralContainerStatuses") or []
    ):
        if c["name"] == name:
            return dict(c)
    raise KeyError(f"no status of container {name} in {p['metadata']['name']}")


# ------------------------------------------------------------ streaming sessions
@contextlib.contextmanager
def background(k: Kubectl, *args: str) -> Iterator[subprocess.Popen[str]]:
    """kubectl `args` running while the block runs (stdin, stdout piped), stopped after it."""
    proc = subprocess.Popen(
        [*k.argv, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        bufsize=1,
    )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for f in (proc.stdin, proc.stdout, proc.stderr):
            if f is not None:
                with contextlib.suppress(OSError):
                    f.close()


def read_until(proc: subprocess.Popen[str], needle: str, timeout: float) -> str:
    """Lines of `proc`'s stdout until one holds `needle` (all of them returned)."""
    assert proc.stdout is not None
    seen: list[str] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready_, _, _ = select.select([proc.stdout], [], [], 1.0)
        if not ready_:
            if proc.poll() is not None:
                break
            continue
        line = proc.stdout.readline()
        if not line:
            break
        seen.append(line)
        if needle in line:
            return "".join(seen)
    err = proc.stderr.read() if proc.stderr is not None and proc.poll() is not None else ""
    raise AssertionError(f"{needle!r} not in kubectl's output: {''.join(seen)[-1500:]!r} {err[-500:]!r}")


@contextlib.contextmanager
def port_forward(k: Kubectl, ns: str, pod_name: str, port: int) -> Iterator[int]:
    """`kubectl port-forward` to the pod's `port` on a free local port, which is yielded."""
    with background(k, "port-forward", "-n", ns, f"pod/{pod_name}", f":{port}") as proc:
        line = read_until(proc, "Forwarding from 127.0.0.1:", 60)
        m = re.search(r"Forwarding from 127\.0\.0\.1:(\d+) ->", line)
        assert m, line
        yield int(m.group(1))


def exec_tty(k: Kubectl, ns: str, pod_name: str, script: str, timeout: float = 60) -> str:
    """`kubectl exec -it POD -- sh`, on a pseudo-terminal of ours, fed `script` then `exit`."""
    master, slave = pty.openpty()
    proc = subprocess.Popen(
        [*k.argv, "exec", "-it", "-n", ns, pod_name, "--", "sh"],
        stdin=slave,
        stdout=slave,
        stderr=slave,
        close_fds=True,
    )
    os.close(slave)
    out = b""
    try:
        os.write(master, (script + "\nexit\n").encode())
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and proc.poll() is None:
            ready_, _, _ = select.select([master], [], [], 0.5)
            if ready_:
                try:
                    out += os.read(master, 65536)
                except OSError:  # the session closed the terminal
                    break
        with contextlib.suppress(OSError):
            while select.select([master], [], [], 0.2)[0]:
                chunk = os.read(master, 65536)
                if not chunk:
                    break
                out += chunk
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        os.close(master)
    return out.decode(errors="replace")
