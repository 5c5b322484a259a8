"""A real kubelet (standalone) against a private cri-shim: end-to-end checks.

The harness starts a cri-shim of its own and a standalone kubelet pointed at
it, which runs the static pods of a directory the harness fills. Two groups
of checks, each a function of the harness returning a `Result`:

- static pods (``pod-*``): what the kubelet makes of its pods through the CRI;
- the kubelet's HTTPS API (``api-*``): pods, running pods, logs, ExecSync,
  exec and port-forward over WebSocket, stats;
- with ``--cni``, the pods on a CNI network of the run's own (``cni-*``): the
  kubelet's podCIDR in the shim's rendered config, pod IPs from that range,
  pod to pod by IP, a hostPort on the host, nothing of the network left.

Run as root:  .venv/bin/python -m tests.e2e.kubelet --handler runv [--keep]
(``--help`` lists the flags). ``CRI_SHIM_KUBELET`` names the kubelet binary
(default: the ``kubelet`` on PATH); ../shared/testenv/TOOLS.md says how to
build v1.26.1.

The modules, each on one concern:

- ``runner``: the processes (shim, kubelet), their work directory, ports and
  clean-up; the clients and waits the checks use;
- ``config``: the kubelet's and the shim's config files and command lines;
- ``host``: what the harness needs of the host (root, registry, tools) and
  puts back (sysctls, the runv network, the CNI network, mounts, its pod logs directory: a private one for kubelets ≥ v1.29);
- ``pods``: the static pods' manifests and how their statuses read;
- ``checks``: results, the check registry and how checks run;
- ``pod_checks``, ``api_checks``, ``cni_checks``: the groups of checks;
- ``logs``: the kubelet's and the shim's problems, grouped for the report;
- ``session``: one run with its report; ``__main__``: the command line.
"""

from tests.e2e.kubelet.checks import CHECKS, Check, CheckFailed, Result, applicable
from tests.e2e.kubelet.host import cni_unsupported, environment_problem, kubelet_binary
from tests.e2e.kubelet.pods import BUSYBOX, LONG, NAMESPACE, PAUSE
from tests.e2e.kubelet.runner import HANDLERS, Harness, free_port
from tests.e2e.kubelet.session import report, run

__all__ = [
    "BUSYBOX",
    "CHECKS",
    "HANDLERS",
    "LONG",
    "NAMESPACE",
    "PAUSE",
    "Check",
    "CheckFailed",
    "Harness",
    "Result",
    "applicable",
    "cni_unsupported",
    "environment_problem",
    "free_port",
    "kubelet_binary",
    "report",
    "run",
]
