"""The static pods the harness gives the kubelet, and how their statuses read."""

from __future__ import annotations

from typing import Any

BUSYBOX = "127.0.0.1:5000/busybox:1.36"
PAUSE = "127.0.0.1:5000/pause:3.10"
NAMESPACE = "default"
PORT_FORWARD_PORT = 8080  # the `two` pod's httpd, which the port-forward check asks for its page
PORT_FORWARD_BODY = "hello-through-port-forward"
WEB_PORT = 8080  # the `web` pod's server (--cni), published on the host by its hostPort
WEB_BODY = "hello-from-web"
# How long the long-running containers sleep: longer than any soak (bench/kubelet_soak.py), whose
# "unexpected restarts" would otherwise be these commands ending after an hour, as they once were.
LONG = "864000"
# Waiting reasons of a container on its way up; any other one is an error.
STARTING = {"", "ContainerCreating", "PodInitializing"}


def _container(name: str, command: list[str], **extra: Any) -> dict[str, Any]:
    return {"name": name, "image": BUSYBOX, "imagePullPolicy": "IfNotPresent", "command": command, **extra}


def _sh(script: str) -> list[str]:
    return ["sh", "-c", script]


def manifests(
    hostdir: str, host_port: int = 0, stop_signals: bool = False, busy: bool = False
) -> dict[str, dict[str, Any]]:
    """The static pods, by short name (the kubelet names them NAME-NODE).

    Commands stick to what the fake backend's built-in shell runs (echo,
    sleep, exit, cat, mkdir, busybox's httpd, `sh -c "a; b"`) where a check
    on fake relies on them: every handler runs the same pods.
    With `host_port` (--cni) also `web`: an HTTP server with that hostPort.
    With `stop_signals` (a v1.33+ kubelet) also `stopsig`: a container with
    `lifecycle.stopSignal` and one without.
    With `busy` also `busy`: a Burstable pod whose container spins (a shell loop), and one that sleeps.
    """
    pods: dict[str, dict[str, Any]] = {
        "net": {"containers": [_container("main", _sh(f"echo line-one; echo line-two; sleep {LONG}"))]},
        "hostnet": {"hostNetwork": True, "containers": [_container("main", ["sleep", LONG])]},
        "init": {
            "initContainers": [
                _container(
                    "init",
                    _sh("echo init-done > /data/marker"),
                    volumeMounts=[{"name": "data", "mountPath": "/data"}],
                )
            ],
            "containers": [
                _container(
                    "app",
                    _sh(f"cat /data/marker; sleep {LONG}"),
                    volumeMounts=[{"name": "data", "mountPath": "/data"}],
                )
            ],
            "volumes": [{"name": "data", "emptyDir": {}}],
        },
        "crash": {"containers": [_container("main", _sh("echo crashing; exit 3"))]},
        "etchosts": {"containers": [_container("main", _sh(f"cat /etc/hosts; sleep {LONG}"))]},
        "termmsg": {
            "restartPolicy": "Never",
            "containers": [_container("main", _sh("printf bye-from-termlog > /dev/termination-log; exit 0"))],
        },
        # The node e2e suite's FallbackToLogsOnError spec: the last output, unterminated, is the message.
        "termlog": {
            "restartPolicy": "Never",
            "containers": [
                _container(
                    "main", _sh("printf DONE; exit 1"), terminationMessagePolicy="FallbackToLogsOnError"
                )
            ],
        },
        "hostpath": {
            "containers": [
                _container(
                    "main",
                    _sh(f"cat /host/hello.txt; sleep {LONG}"),
                    volumeMounts=[{"name": "host", "mountPath": "/host", "readOnly": True}],
                )
            ],
            "volumes": [{"name": "host", "hostPath": {"path": hostdir, "type": "Directory"}}],
        },
        "two": {
            "containers": [
                _container("sleeper", ["sleep", LONG]),
                _container(
                    "httpd",
                    _sh(
                        f"mkdir -p /www && echo {PORT_FORWARD_BODY} > /www/index.html"
                        f" && exec httpd -f -p {PORT_FORWARD_PORT} -h /www"
                    ),
                    ports=[{"containerPort": PORT_FORWARD_PORT, "protocol": "TCP"}],
                ),
            ]
        },
        "gone": {"containers": [_container("main", ["sleep", LONG])]},
    }
    if host_port:
        serve = f"echo {WEB_BODY} > /tmp/index.html; exec httpd -f -p {WEB_PORT} -h /tmp"
        pods["web"] = {
            "containers": [
                _container(
                    "main",
                    _sh(serve),
                    ports=[{"containerPort": WEB_PORT, "hostPort": host_port, "protocol": "TCP"}],
                )
            ]
        }
    if stop_signals:
        traps = f"trap 'echo got-usr1; exit 0' USR1; trap 'echo got-term; exit 0' TERM; sleep {LONG} & wait"
        pods["stopsig"] = {
            "os": {"name": "linux"},  # what the API asks of a pod with a stop signal
            "containers": [
                _container("usr1", _sh(traps), lifecycle={"stopSignal": "SIGUSR1"}),
                _container("default", _sh(traps)),
            ],
        }
    if busy:
        requests = {"resources": {"requests": {"cpu": "100m", "memory": "32Mi"}}}
        pods["busy"] = {
            "containers": [
                _container("spin", _sh("while :; do :; done"), **requests),
                _container("idle", ["sleep", LONG], **requests),
            ]
        }
    out = {}
    for name, spec in pods.items():
        spec.setdefault("restartPolicy", "Always")
        # sleep as PID 1 ignores SIGTERM: keep the kill (and teardown) short.
        spec["terminationGracePeriodSeconds"] = 2
        out[name] = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "namespace": NAMESPACE, "labels": {"e2e": "kubelet-harness"}},
            "spec": spec,
        }
    return out


def container_status(pod: dict[str, Any], name: str, *, init: bool = False) -> dict[str, Any] | None:
    key = "initContainerStatuses" if init else "containerStatuses"
    for s in pod.get("status", {}).get(key) or []:
        if s.get("name") == name:
            return dict(s)
    return None


def describe(status: dict[str, Any] | None) -> str:
    if status is None:
        return "no container status"
    state = status.get("state") or {}
    parts = []
    for kind, detail in state.items():
        reason = detail.get("reason", "")
        msg = detail.get("message", "")
        extra = f" exit {detail['exitCode']}" if "exitCode" in detail else ""
        parts.append(f"{kind} {reason}{extra} {msg}".strip())
    parts.append(f"restarts {status.get('restartCount', 0)}")
    return "; ".join(parts)[:400]


def settled(pod: dict[str, Any] | None) -> bool:
    if pod is None:
        return False
    spec, status = pod.get("spec", {}), pod.get("status", {})
    if status.get("phase") in ("Succeeded", "Failed"):
        return True
    groups = [("initContainers", "initContainerStatuses"), ("containers", "containerStatuses")]
    for spec_key, status_key in groups:
        by_name = {s.get("name"): s for s in status.get(status_key) or []}
        for c in spec.get(spec_key) or []:
            s = by_name.get(c["name"])
            if s is None:
                # App containers have no status while an init container fails.
                if spec_key == "containers" and init_failing(status):
                    continue
                return False
            waiting = (s.get("state") or {}).get("waiting")
            if waiting is not None and waiting.get("reason", "") in STARTING:
                if spec_key == "containers" and init_failing(status):
                    continue
                return False
    return True


def init_failing(status: dict[str, Any]) -> bool:
    for s in status.get("initContainerStatuses") or []:
        waiting = (s.get("state") or {}).get("waiting")
        if waiting is not None and waiting.get("reason", "") not in STARTING:
            return True
        terminated = (s.get("state") or {}).get("terminated")
        if terminated is not None and terminated.get("exitCode") != 0:
            return True
    return False
