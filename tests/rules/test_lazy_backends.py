"""Backends are imported by type when a handler of that type is configured (backends/registry.py).

A node with only fake handlers never imports ``backends.docker`` or
``backends.runv``, nor the Docker SDK (``docker``, and ``requests`` under it):
they cost memory a hollow or test node has no use for. The ``cri-shim serve``
command runs in a fresh interpreter (this one has them loaded for other tests)
with the default configuration's one fake handler, serves, is stopped by
SIGTERM and then says which of those modules it holds.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
HEAVY = ("docker", "requests", "backends.docker", "backends.runv")

SERVE = textwrap.dedent(
    """
    import json, os, signal, sys, threading, time
    from shim import cli

    root = sys.argv[1]
    with open(f"{root}/cri-shim.toml", "w") as f:
        f.write(
            f'[server]\\nlisten = "unix://{root}/cri.sock"\\nstate_dir = "{root}/state"\\n'
            f'[nri]\\nsocket_path = "{root}/nri.sock"\\n'
        )

    def stop_once_serving():
        until = time.monotonic() + 60
        while not os.path.exists(f"{root}/cri.sock") and time.monotonic() < until:
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=stop_once_serving, daemon=True).start()
    status = cli.main(["serve", "--config", f"{root}/cri-shim.toml"])
    heavy = tuple(sys.argv[2:])
    print("loaded", json.dumps(sorted(m for m in sys.modules if m in heavy or m.startswith(tuple(h + "." for h in heavy)))))
    sys.exit(status)
    """
)


def test_a_fake_only_node_imports_no_other_backend_nor_the_docker_sdk(short_tmp: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", SERVE, short_tmp, *HEAVY],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=90,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "server.ready" in out and "handlers=['fake']" in out, out
    [loaded] = [line.split(" ", 1)[1] for line in proc.stdout.splitlines() if line.startswith("loaded ")]
    assert json.loads(loaded) == []


def test_the_check_sees_a_docker_handler() -> None:
    """A docker handler imports its backend: the listing above would show it."""
    script = (
        "import sys; from backends.registry import create_backend; "
        "create_backend('docker', 'docker', {}); "
        "print('backends.docker' in sys.modules)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert proc.stdout.split() == ["True"], proc.stdout + proc.stderr
