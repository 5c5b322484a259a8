"""The command line: ``python -m tests.e2e.kubelet --handler runv [--keep] [--cni]``, as root.

Prints a table check -> pass/fail with a reason, the kubelet's error lines
(klog level E, grouped and counted) and the shim's error events; exits 1 when
a check failed, 2 when the harness cannot run here.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
from collections.abc import Iterator

from tests.e2e import kubelet
from tests.e2e.kubelet.host import cni_unsupported, environment_problem
from tests.e2e.kubelet.runner import HANDLERS
from tests.e2e.kubelet.session import run


@contextlib.contextmanager
def _deadline(seconds: float) -> Iterator[None]:
    """SIGALRM after `seconds`: a stuck run still stops what it started (in run's finally)."""

    def alarm(signum: int, frame: object) -> None:
        raise TimeoutError(f"the harness ran over {seconds:.0f} s")

    previous = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(int(seconds))
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m tests.e2e.kubelet", description=(kubelet.__doc__ or "").split("\n")[0]
    )
    p.add_argument("--handler", choices=HANDLERS, default="runv")
    p.add_argument("--keep", action="store_true", help="keep the work directory and logs")
    p.add_argument("--check", action="append", help="run only this check (repeatable), e.g. pod-crash-loop")
    p.add_argument(
        "--warm",
        type=int,
        default=0,
        help="runv: warm VMs, docker: warm pause containers kept ready (0: off)",
    )
    p.add_argument("--driver", choices=("stub", "qemu"), default="stub", help="runv: the hypervisor driver")
    p.add_argument(
        "--transport", choices=("native", "grpcio"), default="native", help="the shim's [server] transport"
    )
    p.add_argument(
        "--hollow",
        type=int,
        default=0,
        help="fake: `cri-shim hollow --nodes N`, the kubelet on the last node",
    )
    p.add_argument("--guest-dir", default="", help="runv qemu: the guest image (default: the driver's)")
    p.add_argument(
        "--cni",
        action="store_true",
        help="pods on a CNI network of the run's own (Debian's bridge + host-local + portmap in "
        '/usr/lib/cni, its config rendered with the kubelet\'s podCIDR; pod_network = "cni"), '
        "and the checks of that network",
    )
    p.add_argument(
        "--qos",
        action="store_true",
        help="the kubelet's pod cgroups (cgroupsPerQOS, under a cgroupRoot of the run's own), a pod "
        "with a busy loop, and the check of its pod-level usage in /stats/summary",
    )
    p.add_argument(
        "--max-seconds", type=float, default=420, help="a last resort: give up (and clean up) after this long"
    )
    args = p.parse_args(argv)
    if args.hollow and args.handler != "fake":
        p.error("--hollow needs --handler fake: only fake nodes can be hollow")
    unsupported = cni_unsupported(args.handler) if args.cni else None
    if unsupported:
        p.error(f"--cni: {unsupported}")
    problem = environment_problem(args.handler, cni=args.cni)
    if problem:
        print(f"cannot run: {problem}", file=sys.stderr)
        return 2
    names = set(args.check) if args.check else None
    with _deadline(args.max_seconds):
        results, _ = run(
            args.handler,
            keep=args.keep,
            names=names,
            warm=args.warm,
            driver=args.driver,
            guest_dir=args.guest_dir,
            transport=args.transport,
            hollow=args.hollow,
            cni=args.cni,
            qos=args.qos,
        )
    return 0 if results and all(r.ok for _, r, _ in results) else 1


if __name__ == "__main__":
    sys.exit(main())
