"""The checks through the kubelet's HTTPS API.

Pods, running pods, logs, ExecSync, exec and port-forward over WebSocket
(proxied by the kubelet to the shim's streaming server; port-forward asks the
pod's busybox httpd for its page), stats.
"""

from __future__ import annotations

import contextlib
import json
import re
import time
from collections.abc import Iterator
from typing import Any

from websockets.exceptions import ConnectionClosed
from websockets.sync.client import ClientConnection

from tests.e2e.kubelet.checks import CheckFailed, Result, check, passed, short
from tests.e2e.kubelet.pods import NAMESPACE, PORT_FORWARD_BODY, PORT_FORWARD_PORT
from tests.e2e.kubelet.runner import Harness

RFC3339 = re.compile(r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(\.\d+)?(Z|[+-]\d{2}:\d{2}) ")


@check("api", 1)
def check_pods(h: Harness) -> Result:
    """/pods lists the static pods"""
    body = json.loads(h.api_ok("GET", "/pods"))
    names = {p["metadata"]["name"] for p in body.get("items") or []}
    want = {h.full(n) for n in h.pods if n != "gone"}
    missing = sorted(want - names)
    if missing:
        raise CheckFailed(f"missing {missing}; has {sorted(names)}")
    return passed(f"{len(names)} pods, all {len(want)} static pods present")


@check("api", 2)
def check_running_pods(h: Harness) -> Result:
    """/runningpods/ lists the pods running in the runtime"""
    h.wait_running("net", "main")
    body = json.loads(h.api_ok("GET", "/runningpods/"))
    names = {p["metadata"]["name"] for p in body.get("items") or []}
    if h.full("net") not in names:
        raise CheckFailed(f"{h.full('net')} missing; has {sorted(names)}")
    return passed(
        f"{len(names)} running pods: {', '.join(sorted(n.removesuffix('-' + h.node) for n in names))}"
    )


@check("api", 3)
def check_container_logs(h: Harness) -> Result:
    """/containerLogs returns the container's output"""
    text = h.wait_log("net", "main", "line-two")
    if "line-one\nline-two" not in text:
        raise CheckFailed(f"unexpected log: {short(text.encode())}")
    return passed(f"{short(text.encode())!r}")


@check("api", 4)
def check_container_logs_timestamps(h: Harness) -> Result:
    """/containerLogs?timestamps=true: every line starts with an RFC3339 time"""
    h.wait_log("net", "main", "line-two")
    text = h.logs("net", "main", "timestamps=true")
    lines = [line for line in text.splitlines() if line]
    bad = [line for line in lines if not RFC3339.match(line)]
    if not lines or bad:
        raise CheckFailed(f"lines without a time: {bad[:3]} (of {len(lines)})")
    return passed(f"{len(lines)} lines, e.g. {lines[0]!r}")


@check("api", 5)
def check_run(h: Harness) -> Result:
    """POST /run (ExecSync) returns the command's output"""
    h.wait_running("net", "main")
    body = h.api_ok("POST", f"/run/{NAMESPACE}/{h.full('net')}/main?cmd=echo+hi")
    if body.strip() != b"hi":
        raise CheckFailed(f"output {body!r}, want b'hi\\n'")
    return passed(f"output {body!r}")


@contextlib.contextmanager
def _websocket(h: Harness, path: str, subprotocols: list[str]) -> Iterator[ClientConnection]:
    """A WebSocket to the kubelet: the far end's close ends the session, a refusal fails the check."""
    try:
        with h.ws(path, subprotocols) as ws:
            yield ws
    except ConnectionClosed:
        pass
    except OSError as exc:
        raise CheckFailed(f"WebSocket {path}: {exc}") from None
    except Exception as exc:
        if type(exc).__name__ == "InvalidStatus":
            raise CheckFailed(f"WebSocket {path}: {exc}") from None
        raise


def _frames(ws: ClientConnection, deadline: float) -> Iterator[tuple[int, bytes]]:
    """Each message's channel (its first byte) and payload, until `deadline`."""
    while time.monotonic() < deadline:
        try:
            msg = ws.recv(timeout=max(0.1, deadline - time.monotonic()))
        except TimeoutError:
            return
        data = msg.encode() if isinstance(msg, str) else msg
        if data:
            yield data[0], data[1:]


def _exec_session(
    h: Harness, query: str, stdin: bytes | None, until: bytes, timeout: float = 15
) -> tuple[bytes, bytes, str]:
    """stdout, stderr and the status of an exec over WebSocket (v4.channel.k8s.io)."""
    h.wait_running("net", "main")
    path = f"/exec/{NAMESPACE}/{h.full('net')}/main?{query}"
    out, err, status = b"", b"", ""
    deadline = time.monotonic() + timeout
    with _websocket(h, path, ["v4.channel.k8s.io"]) as ws:
        if ws.subprotocol != "v4.channel.k8s.io":
            raise CheckFailed(f"negotiated subprotocol {ws.subprotocol!r}")
        if stdin is not None:
            ws.send(b"\x00" + stdin)
        for channel, payload in _frames(ws, deadline):
            if channel == 1:
                out += payload
            elif channel == 2:
                err += payload
            elif channel == 3:
                status += payload.decode(errors="replace")
                if until in out:
                    break
    return out, err, status


@check("api", 6)
def check_exec_websocket(h: Harness) -> Result:
    """WebSocket /exec: output on channel 1, Success on channel 3"""
    out, err, status = _exec_session(h, "command=echo&command=hello&output=1", None, b"hello")
    if out.strip() != b"hello":
        raise CheckFailed(f"stdout {out!r}, stderr {err!r}, status {status!r}")
    if '"Success"' not in status:
        raise CheckFailed(f"stdout ok, status {status!r}")
    return passed(f"stdout {out!r}, status {json.loads(status).get('status')}")


@check("api", 7)
def check_exec_websocket_stdin(h: Harness) -> Result:
    """WebSocket /exec with stdin: a line sent on channel 0 comes back"""
    line = b"ping-" + h.tag.encode() + b"\n"
    out, err, status = _exec_session(h, "command=head&command=-n1&input=1&output=1", line, line)
    if out != line:
        raise CheckFailed(f"stdout {out!r}, want {line!r}; stderr {err!r}, status {status!r}")
    return passed(f"echoed {line!r}, status {_status_word(status)}")


def _status_word(status: str) -> str:
    try:
        return str(json.loads(status).get("status"))
    except ValueError:
        return repr(status)


@check("api", 8, timeout=45)
def check_port_forward_websocket(h: Harness) -> Result:
    """WebSocket /portForward: an HTTP GET reaches the pod's httpd and gets its page"""
    h.wait_running("two", "httpd")
    deadline = time.monotonic() + 20
    while True:
        # Running is not listening: until httpd has bound its port, a runtime refuses (the fake echoes).
        ports, got, errors = _port_forward_get(h, PORT_FORWARD_PORT, time.monotonic() + 10)
        if ports != {0: PORT_FORWARD_PORT, 1: PORT_FORWARD_PORT}:
            raise CheckFailed(
                f"port headers {ports}, want {PORT_FORWARD_PORT} on channels 0 and 1; error {errors!r}"
            )
        page = PORT_FORWARD_BODY.encode() + b"\n"
        head, _, body = got.partition(b"\r\n\r\n")
        status = head.split(b"\r\n", 1)[0]
        if re.fullmatch(rb"HTTP/1\.[01] 200 OK", status) and body == page:
            length = re.search(rb"(?im)^content-length: *(\d+)\r?$", head)
            if length is None or int(length[1]) != len(page):
                raise CheckFailed(f"200 and the page, but Content-Length {length and length[1]!r}: {head!r}")
            return passed(
                f"port headers {PORT_FORWARD_PORT}/{PORT_FORWARD_PORT}, GET /: {status.decode()}, {body!r}"
            )
        if time.monotonic() >= deadline:
            raise CheckFailed(
                f"GET / through port {PORT_FORWARD_PORT}: got {short(got)!r}; error channel {errors!r}"
            )
        time.sleep(1)


def _port_forward_get(h: Harness, port: int, deadline: float) -> tuple[dict[int, int | None], bytes, bytes]:
    """One port-forward over WebSocket to the `two` pod: the ports its channels announce, what a
    GET / sent on channel 0 got back until the server closed or the page came, the error channel."""
    path = f"/portForward/{NAMESPACE}/{h.full('two')}?port={port}"
    request = b"GET / HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"
    got, errors, headers = b"", b"", {0: b"", 1: b""}
    with _websocket(h, path, ["v4.channel.k8s.io", "portforward.k8s.io"]) as ws:
        sent = False
        for channel, body in _frames(ws, deadline):
            if channel in headers and len(headers[channel]) < 2:
                # each channel first carries the port, 2 bytes little-endian
                take = 2 - len(headers[channel])
                headers[channel] += body[:take]
                body = body[take:]
            if channel == 0:
                got += body
            elif channel == 1:
                errors += body
            if not sent and len(headers[0]) == 2 and len(headers[1]) == 2:
                ws.send(b"\x00" + request)
                sent = True
            if errors or PORT_FORWARD_BODY.encode() + b"\n" in got or got == request:
                break
    ports = {ch: int.from_bytes(v, "little") if len(v) == 2 else None for ch, v in headers.items()}
    return ports, got, errors


@check("api", 9, timeout=45)
def check_stats_summary(h: Harness) -> Result:
    """/stats/summary has CPU and memory for a running container"""
    h.wait_running("net", "main")
    deadline = time.monotonic() + 40
    found: dict[str, Any] | None = None
    error = ""
    while time.monotonic() < deadline:
        # Early on the kubelet answers 500 (cAdvisor has no root filesystem stats yet).
        try:
            summary = json.loads(h.api_ok("GET", "/stats/summary", timeout=20))
        except CheckFailed as exc:
            error = str(exc)
            time.sleep(3)
            continue
        for p in summary.get("pods") or []:
            if p.get("podRef", {}).get("name") != h.full("net"):
                continue
            for c in p.get("containers") or []:
                if c.get("name") == "main":
                    found = c
        if found is not None:
            cpu, mem = found.get("cpu") or {}, found.get("memory") or {}
            has_cpu = cpu.get("usageNanoCores") is not None or cpu.get("usageCoreNanoSeconds") is not None
            if has_cpu and mem.get("workingSetBytes") is not None:
                return passed(
                    f"usageNanoCores {cpu.get('usageNanoCores')}, "
                    f"usageCoreNanoSeconds {cpu.get('usageCoreNanoSeconds')}, "
                    f"workingSetBytes {mem['workingSetBytes']}"
                )
        time.sleep(3)
    if found is None:
        raise CheckFailed(error or f"no stats for {h.full('net')}/main in /stats/summary")
    raise CheckFailed(f"incomplete stats: cpu {found.get('cpu')}, memory {found.get('memory')}")


@check("api", 10, timeout=150, when=lambda h: h.qos)
def check_pod_usage(h: Harness) -> Result:
    """/stats/summary's pod-level CPU and memory of a pod whose container spins cover its containers'"""
    h.wait_running("busy", "spin", timeout=60 * h.patience)
    deadline = time.monotonic() + 120 * min(h.patience, 2.0)
    last = ""
    while time.monotonic() < deadline:
        try:
            summary = json.loads(h.api_ok("GET", "/stats/summary", timeout=20))
        except CheckFailed as exc:
            last = str(exc)
            time.sleep(3)
            continue
        pod = next(
            (p for p in summary.get("pods") or [] if p.get("podRef", {}).get("name") == h.full("busy")), None
        )
        if pod is None:
            last = f"no {h.full('busy')} in /stats/summary"
            time.sleep(3)
            continue
        cpu = (pod.get("cpu") or {}).get("usageNanoCores") or 0
        mem = (pod.get("memory") or {}).get("workingSetBytes") or 0
        ct_cpu = sum(((c.get("cpu") or {}).get("usageNanoCores") or 0) for c in pod.get("containers") or [])
        ct_mem = sum(
            ((c.get("memory") or {}).get("workingSetBytes") or 0) for c in pod.get("containers") or []
        )
        figures = f"pod cpu {cpu / 1e9:.2f} cores, memory {mem >> 20} MiB; containers {ct_cpu / 1e9:.2f}, {ct_mem >> 20} MiB"
        # The spinning container takes a core (or what the host gives it): the pod's cgroup, which
        # holds the container (and a VM's own processes with runv), shows at least that.
        if cpu >= 0.2e9 and mem > 0 and ct_cpu > 0 and cpu >= 0.8 * ct_cpu and mem >= 0.8 * ct_mem:
            return passed(figures)
        last = figures
        time.sleep(3)
    raise CheckFailed(last)
