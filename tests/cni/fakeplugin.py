"""A fake CNI plugin, installed by tests under any type name, steered by its own config.

Its plugin config object carries a ``fake`` object (the runtime passes plugin fields through):

- ``log``: a file to which every call appends ``{"plugin", "env" (CNI_*), "stdin", "t0", "t1"}``;
- ``<COMMAND>`` (ADD, DEL, CHECK, STATUS, GC): what to do for it, any of
  ``{"error": {...}}`` (print it, exit 1), ``{"error": {...}, "stream": "stderr"}``,
  ``{"exit": N, "stderr": "text"}``, ``{"result": {...}}`` (ADD's output),
  ``{"stdout": "raw text"}``, ``{"hang": "/pidfile"}`` (start a child, write both PIDs, sleep),
  ``{"sleep": seconds}``, ``{"meet": [dir, n]}`` (put CNI_CONTAINERID in ``dir``, wait until
  ``n`` are there; fail after 10 s).

An ADD without ``result`` passes ``prevResult`` on, or answers a result in the requested version
with ``CNI_IFNAME`` in ``CNI_NETNS`` holding ``fake.ip`` (default 10.88.0.2/24).
"""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path
from typing import Any

SCRIPT = r"""
import json, os, sys, time

t0 = time.time()
conf = json.load(sys.stdin)
cmd = os.environ.get("CNI_COMMAND", "")
fake = conf.get("fake", {})
act = fake.get(cmd, {})


def record():
    if fake.get("log"):
        env = {k: v for k, v in os.environ.items() if k.startswith("CNI_")}
        entry = {"plugin": os.path.basename(sys.argv[0]), "env": env, "stdin": conf, "t0": t0, "t1": time.time()}
        with open(fake["log"], "a") as f:
            f.write(json.dumps(entry) + "\n")


if "meet" in act:
    meeting, count = act["meet"]
    os.makedirs(meeting, exist_ok=True)
    open(os.path.join(meeting, os.environ.get("CNI_CONTAINERID", "none")), "w").close()
    deadline = time.time() + 10
    while len(os.listdir(meeting)) < count:
        if time.time() > deadline:
            print(json.dumps({"code": 101, "msg": "nobody came to " + meeting}))
            sys.exit(1)
        time.sleep(0.02)
if "sleep" in act:
    time.sleep(act["sleep"])
if "hang" in act:
    import subprocess

    child = subprocess.Popen(["sleep", "300"])
    with open(act["hang"], "w") as f:
        f.write("%d %d" % (os.getpid(), child.pid))
    time.sleep(300)
record()
if "error" in act:
    out = sys.stderr if act.get("stream") == "stderr" else sys.stdout
    out.write(json.dumps(act["error"]))
    sys.exit(1)
if "exit" in act:
    sys.stderr.write(act.get("stderr", ""))
    sys.exit(act["exit"])
if "stdout" in act:
    sys.stdout.write(act["stdout"])
elif cmd == "ADD":
    if "result" in act:
        result = act["result"]
    elif "prevResult" in conf:
        result = conf["prevResult"]
    else:
        result = {
            "cniVersion": conf["cniVersion"],
            "interfaces": [{"name": os.environ["CNI_IFNAME"], "sandbox": os.environ.get("CNI_NETNS", "")}],
            "ips": [{"address": fake.get("ip", "10.88.0.2/24"), "interface": 0}],
        }
    print(json.dumps(result))
"""


def install(bin_dir: Path, *names: str) -> None:
    """The fake, as an executable of each name in ``bin_dir``."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    for name in names:
        path = bin_dir / name
        # -IS: no site-packages to import, a quicker start (the script needs the standard library only).
        path.write_text(f"#!{sys.executable} -IS\n{SCRIPT}")
        path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)


def calls(log: Path) -> list[dict[str, Any]]:
    """What the fakes recorded, in order."""
    if not log.exists():
        return []
    return [json.loads(line) for line in log.read_text().splitlines()]


def alive(pid: int) -> bool:
    """A process that exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def plugin(type_: str, log: Path, **fake: object) -> dict[str, Any]:
    """A plugin config object for the fake."""
    return {"type": type_, "fake": {"log": str(log), **fake}}


def conflist(name: str, version: str, *plugins: dict[str, Any], **extra: object) -> dict[str, Any]:
    return {"cniVersion": version, "name": name, "plugins": list(plugins), **extra}


def write_json(path: Path, obj: object) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp-write")
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, path)
    return path
