"""The processes the harness starts, recorded so that another process (``down``) stops exactly them.

Each daemon runs in a session of its own with its output in LOGS/NAME.log. The state file
(layout.STATE) holds, per name, the PID, the process's start time (field 22 of /proc/PID/stat, in
clock ticks since boot) and the command line: a PID is only signalled while its start time is the
recorded one, so a PID the kernel gave to another process since is never touched.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from tests.e2e.cluster.layout import LOGS, STATE

# Popen objects of the daemons this process started, to reap them (the others are reaped by init).
_children: dict[int, subprocess.Popen[bytes]] = {}


def start_time(pid: int) -> int | None:
    """The process's start time in clock ticks, or None when there is no such live process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()
    if fields[0] == "Z":  # exited, not yet reaped
        return None
    return int(fields[19])


def load() -> dict[str, Any]:
    try:
        data: dict[str, Any] = json.loads(STATE.read_text())
    except (OSError, ValueError):
        return {"procs": {}}
    data.setdefault("procs", {})
    return data


def save(data: dict[str, Any]) -> None:
    STATE.parent.mkdir(parents=True, exist_ok=True)
    tmp = STATE.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    tmp.replace(STATE)


def update(**fields: Any) -> None:
    data = load()
    data.update(fields)
    save(data)


def record(name: str) -> dict[str, Any] | None:
    rec: dict[str, Any] | None = load()["procs"].get(name)
    return rec


def alive(name: str) -> bool:
    rec = record(name)
    return rec is not None and start_time(rec["pid"]) == rec["start"]


def pid(name: str) -> int:
    rec = record(name)
    if rec is None:
        raise KeyError(f"{name} was not started by the harness")
    return int(rec["pid"])


def log_path(name: str) -> Path:
    return LOGS / f"{name}.log"


def start(name: str, argv: list[str], cwd: Path | None = None, env: dict[str, str] | None = None) -> int:
    """Start `argv` as daemon `name` (its output appended to its log); record it; return its PID."""
    LOGS.mkdir(parents=True, exist_ok=True)
    with open(log_path(name), "ab") as out:
        out.write(f"---- {time.strftime('%Y-%m-%dT%H:%M:%S')} {' '.join(argv)}\n".encode())
        out.flush()
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=str(cwd) if cwd else None,
            env=env,
            start_new_session=True,
        )
    _children[proc.pid] = proc
    started = None
    for _ in range(50):
        started = start_time(proc.pid)
        if started is not None or proc.poll() is not None:
            break
        time.sleep(0.01)
    data = load()
    data["procs"][name] = {"pid": proc.pid, "start": started, "argv": argv}
    save(data)
    return proc.pid


def exited(name: str) -> int | None:
    """The exit code of daemon `name` if this process started it and it has exited, else None."""
    rec = record(name)
    if rec is None:
        return None
    proc = _children.get(rec["pid"])
    return proc.poll() if proc is not None else None


def _wait_gone(pid: int, started: int, timeout: float) -> bool:
    proc = _children.get(pid)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(0.1)
        if start_time(pid) != started:
            return True
        time.sleep(0.1)
    return start_time(pid) != started


def signal_daemon(name: str, sig: int) -> None:
    """Send `sig` to daemon `name` if it still is the process the harness started."""
    rec = record(name)
    if rec is not None and start_time(rec["pid"]) == rec["start"]:
        os.kill(rec["pid"], sig)


def stop(name: str, grace: float = 20.0, sig: int = signal.SIGTERM, sent: bool = False) -> str:
    """Stop daemon `name`: `sig` (unless `sent` says it was sent already), then SIGKILL after
    `grace` seconds. Returns what happened."""
    data = load()
    rec = data["procs"].get(name)
    if rec is None:
        return f"{name}: not started"
    pid_, started = rec["pid"], rec["start"]
    how = f"stopped by {signal.Signals(sig).name}" if sent else "had exited"
    if start_time(pid_) == started:
        if not sent:
            os.kill(pid_, sig)
        how = f"stopped by {signal.Signals(sig).name}"
        if not _wait_gone(pid_, started, grace):
            os.kill(pid_, signal.SIGKILL)
            how = f"SIGKILLed after ignoring {signal.Signals(sig).name} for {grace:.0f} s"
            _wait_gone(pid_, started, 30)
    proc = _children.pop(pid_, None)
    if proc is not None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(1)
    data = load()
    data["procs"].pop(name, None)
    save(data)
    return f"{name} (pid {pid_}): {how}"


def stop_all(names: list[str], grace: float = 20.0) -> list[str]:
    """Stop many daemons at once: SIGTERM to each, then `stop` each (which waits, then SIGKILLs).
    Tens of kubelets stopped one after the other would take as many times their shutdown."""
    sent = {name for name in names if alive(name)}
    for name in sent:
        signal_daemon(name, signal.SIGTERM)
    return [stop(name, grace=grace, sent=name in sent) for name in names]


def live() -> list[str]:
    """The recorded daemons still running, each as `name (pid N)`."""
    return [
        f"{name} (pid {rec['pid']})"
        for name, rec in load()["procs"].items()
        if start_time(rec["pid"]) == rec["start"]
    ]


def mentioning(*paths: Path) -> list[str]:
    """Processes whose command line names one of `paths` (what the daemons started: runv's VMs, ...)."""
    needles = [str(p).encode() for p in paths]
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        with contextlib.suppress(OSError):
            cmdline = (d / "cmdline").read_bytes()
            if cmdline and any(n in cmdline for n in needles) and start_time(int(d.name)) is not None:
                text = cmdline.replace(b"\0", b" ").decode(errors="replace")
                out.append(f"pid {d.name}: {text[:160]}")
    return out


def stop_mentioning(*paths: Path, grace: float = 10.0) -> list[str]:
    """Stop the processes whose command line names one of `paths` (`mentioning`): SIGTERM, SIGKILL
    after `grace` seconds; each signalled by PID while its start time is the one first seen.
    Returns what was stopped and how."""
    seen: dict[int, tuple[int, str]] = {}
    for line in mentioning(*paths):
        pid_ = int(line.split()[1].rstrip(":"))
        started = start_time(pid_)
        if started is not None:
            seen[pid_] = (started, line)
    for pid_, (started, _) in seen.items():
        if start_time(pid_) == started:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid_, signal.SIGTERM)
    out = []
    for pid_, (started, line) in seen.items():
        how = "SIGTERM"
        if not _wait_gone(pid_, started, grace):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid_, signal.SIGKILL)
            how = f"SIGKILL after {grace:.0f} s"
            _wait_gone(pid_, started, 10)
        out.append(f"{line} ({how})")
    return out
