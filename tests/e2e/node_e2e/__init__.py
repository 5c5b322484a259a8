"""SIG-Node's node e2e suite (Kubernetes v1.35 ``e2e_node.test``) against a private cri-shim.

The suite runs etcd, an API server and a namespace controller in its own
process and starts a real kubelet from ``--k8s-bin-dir``; this runner gives
it a cri-shim of its own (the kubelet harness's: own socket, state directory
and, for runv, network; the handler as default; pause image
registry.k8s.io/pause:3.10.1), a kubelet config made from the tree's
``default-kubelet-config.yaml``, and hides ``systemd-run`` while it runs. It
then prints passed / failed / skipped with each failure's first line (from
ginkgo's JSON report), against a baseline if given, removes the sandboxes
the suite leaves behind through the shim's CRI and stops the shim.

Run as root, opt-in (the suite's kubelet uses /var/lib/kubelet and ports
10248, 10250, 10255 and 6443, which must be free)::

    E2E_NODE_TEST=.../e2e_node.test CRI_SHIM_KUBELET=.../kubelet-1.35 \\
    E2E_NODE_KUBELET_CONFIG=TREE/test/e2e_node/jenkins/default-kubelet-config.yaml \\
    python -m tests.e2e.node_e2e --handler docker [--focus REGEX] [--label-filter EXPR]

../shared/testenv/TOOLS.md says how to build both binaries and the images.
Modules: ``suite`` (checks, set-up, the run, clean-up), ``report`` (the
ginkgo report read, printed, compared), ``__main__`` (the command line).
"""

from tests.e2e.node_e2e.report import Spec, counts, load, print_report, read_baseline
from tests.e2e.node_e2e.suite import LABELS, Binaries, RunOptions, environment_problem, run

__all__ = [
    "LABELS",
    "Binaries",
    "RunOptions",
    "Spec",
    "counts",
    "environment_problem",
    "load",
    "print_report",
    "read_baseline",
    "run",
]
