"""kubectl with the harness's admin kubeconfig, and the waits the bring-up and the scenarios share."""

from __future__ import annotations

import json
import shlex
import subprocess
import time
from collections.abc import Callable
from typing import Any, TypeVar

from tests.e2e.cluster.layout import Binaries
from tests.e2e.cluster.pki import admin_kubeconfig

T = TypeVar("T")


class KubectlError(RuntimeError):
    pass


class Kubectl:
    def __init__(self, binaries: Binaries) -> None:
        self.argv = [binaries.path("kubectl"), f"--kubeconfig={admin_kubeconfig()}"]

    def run(
        self, *args: str, input: str | None = None, timeout: float = 120, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(
            [*self.argv, *args], input=input, capture_output=True, text=True, timeout=timeout, check=False
        )
        if check and proc.returncode != 0:
            raise KubectlError(
                f"kubectl {shlex.join(args)} failed ({proc.returncode}): "
                f"{(proc.stderr or proc.stdout).strip()[-2000:]}"
            )
        return proc

    def __call__(self, *args: str, input: str | None = None, timeout: float = 120) -> str:
        return self.run(*args, input=input, timeout=timeout).stdout

    def json(self, *args: str, timeout: float = 60) -> Any:
        return json.loads(self.run(*args, "-o", "json", timeout=timeout).stdout)

    def apply(self, *objects: dict[str, Any], namespace: str | None = None) -> None:
        doc = {"apiVersion": "v1", "kind": "List", "items": list(objects)}
        ns = ["-n", namespace] if namespace else []
        self.run("apply", *ns, "-f", "-", input=json.dumps(doc))

    def get(self, kind: str, name: str, namespace: str | None = None) -> Any:
        ns = ["-n", namespace] if namespace else []
        proc = self.run("get", kind, name, *ns, "-o", "json", check=False)
        if proc.returncode != 0:
            if "NotFound" in proc.stderr:
                return None
            raise KubectlError(f"kubectl get {kind} {name}: {proc.stderr.strip()}")
        return json.loads(proc.stdout)


def wait_for(what: str, probe: Callable[[], T | None], timeout: float, interval: float = 1.0) -> T:
    """Call `probe` until it returns something other than None (or False); raise after `timeout`."""
    deadline = time.monotonic() + timeout
    last_error = ""
    while True:
        try:
            got = probe()
            if got is not None and got is not False:
                return got
        except (KubectlError, OSError, ValueError, KeyError) as exc:
            last_error = f": last error {exc}"
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{what}: not after {timeout:.0f} s{last_error}")
        time.sleep(interval)


def condition(obj: dict[str, Any], kind: str) -> dict[str, Any] | None:
    for c in obj.get("status", {}).get("conditions") or []:
        if c.get("type") == kind:
            return dict(c)
    return None


def node_ready(node: dict[str, Any]) -> bool:
    c = condition(node, "Ready")
    return c is not None and c.get("status") == "True"
