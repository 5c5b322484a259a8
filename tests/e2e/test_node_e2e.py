"""SIG-Node's node e2e suite on a private cri-shim (tests/e2e/node_e2e), and how its report reads.

The end-to-end test is opt-in: it runs only when E2E_NODE_TEST,
CRI_SHIM_KUBELET and E2E_NODE_KUBELET_CONFIG name the suite, a v1.35 kubelet
and the tree's default kubelet config (the suite's kubelet takes
/var/lib/kubelet and fixed ports); skipped, also in CI, without them. It runs
a few Conformance specs that pass on containerd here, on docker and runv.
"""

from __future__ import annotations

import datetime
import io
import json
import re
import shutil
import subprocess
import types
import typing
from pathlib import Path

import pytest

import shim.config
from tests.e2e import node_e2e
from tests.e2e.kubelet.config import shim_config
from tests.e2e.kubelet.runner import Harness
from tests.e2e.node_e2e import suite


def _spec(texts: list[str], leaf: str, state: str, message: str = "") -> dict:
    return {
        "ContainerHierarchyTexts": texts,
        "LeafNodeType": "It",
        "LeafNodeText": leaf,
        "State": state,
        "RunTime": 2_500_000_000,
        "Failure": {"Message": message} if message else {},
    }


def test_report_counts_what_ran_and_names_failures(tmp_path: Path) -> None:
    specs = [
        _spec(["[sig-node] Containers"], "should use the image defaults [NodeConformance]", "passed"),
        _spec(["[sig-node] Pods"], "should fail", "failed", "\nExpected\n    <int>: 1\nto equal 0\n"),
        _spec(["[sig-node] Pods"], "should time out", "timedout", "A spec timeout occurred"),
        _spec(["[sig-node] AppArmor"], "should load", "skipped", "Only supported on AppArmor hosts"),
        _spec(["[sig-node] Serial"], "not selected", "skipped"),
        {"LeafNodeType": "SynchronizedBeforeSuite", "State": "passed"},
    ]
    path = tmp_path / "report.json"
    path.write_text(json.dumps([{"SuiteSucceeded": False, "SpecReports": specs}]))

    loaded = node_e2e.load(path)

    assert [s.ran for s in loaded] == [True, True, True, True, False]
    assert node_e2e.counts(loaded) == {"passed": 1, "failed": 2, "skipped": 1}
    assert loaded[1].name == "[It] [sig-node] Pods should fail"
    assert loaded[1].error == "Expected"
    baseline = tmp_path / "baseline.txt"
    baseline.write_text(
        "# containerd\npassed\t[It] [sig-node] Pods should fail\nfailed\t[It] [sig-node] Pods should time out\n"
    )
    out = io.StringIO()
    node_e2e.print_report("t", loaded, node_e2e.read_baseline(baseline), out)
    text = out.getvalue()
    assert "passed 1, failed 2, skipped 1" in text
    assert "FAIL (failed, 2s) [It] [sig-node] Pods should fail\n       Expected" in text
    assert "baseline passed, this run did not: 1\n     failed  [It] [sig-node] Pods should fail" in text
    assert "this run passed, baseline did not: 0" in text


FOCUS = "Containers should|ContainerLogPath"


@pytest.mark.slow
@pytest.mark.timeout(1500)
@pytest.mark.parametrize("handler", ["docker", "runv"])
def test_node_e2e_conformance_sample(handler: str, tmp_path: Path) -> None:
    binaries = node_e2e.Binaries.from_env()
    if not (binaries.suite and binaries.kubelet and binaries.kubelet_config):
        pytest.skip(
            "set E2E_NODE_TEST, CRI_SHIM_KUBELET and E2E_NODE_KUBELET_CONFIG to run the node e2e suite"
        )
    problem = node_e2e.environment_problem(handler, binaries)
    if problem:
        pytest.skip(problem)
    rc, _ = node_e2e.run(handler, binaries, tmp_path, node_e2e.RunOptions(1200, focus=FOCUS))
    specs = node_e2e.load(tmp_path / "report.json")
    out = io.StringIO()
    node_e2e.print_report(f"node e2e, {handler}", specs, None, out)
    print(out.getvalue())
    n = node_e2e.counts(specs)
    # Containers should (4) and ContainerLogPath (2): all pass on containerd here.
    assert n["passed"] >= 6, out.getvalue()
    assert n["failed"] == 0 and rc == 0, out.getvalue()


def test_parallel_runs_go_through_the_ginkgo_cli_with_its_flags_bare(tmp_path: Path) -> None:
    config = tmp_path / "base.yaml"
    config.write_text("kind: KubeletConfiguration\n")
    b = node_e2e.Binaries("/bin/e2e_node.test", "/bin/kubelet", str(config), "/bin/ginkgo")
    serial = suite.suite_argv("unix:///s.sock", "n1", b, tmp_path, "NodeConformance", "Pods", 1)
    parallel = suite.suite_argv("unix:///s.sock", "n1", b, tmp_path, "NodeConformance", "Pods", 3)

    assert serial[0] == "/bin/e2e_node.test"
    assert "--ginkgo.label-filter=NodeConformance" in serial and "--ginkgo.focus=Pods" in serial
    assert parallel[:2] == ["/bin/ginkgo", "--procs=3"]
    sep = parallel.index("--")
    assert parallel[sep - 1] == "/bin/e2e_node.test"
    assert "--label-filter=NodeConformance" in parallel[:sep] and "--focus=Pods" in parallel[:sep]
    # The suite's own flags follow the separator, the same in both forms.
    assert parallel[sep + 1 :] == [a for a in serial[1:] if not a.startswith("--ginkgo.")]
    assert "failCgroupV1: false" in (tmp_path / "kubelet-config.yaml").read_text()
    assert node_e2e.Binaries("/x", "/y", str(config)).problem(procs=2) is not None


def test_the_nmeter_stand_in_stamps_milliseconds_as_the_lifecycle_specs_read_them(tmp_path: Path) -> None:
    """scripts/testenv/src/nmeter.c: `date -u +%FT$(nmeter -d0 '%3t' | head -n1)Z` must be RFC 3339."""
    gcc = shutil.which("gcc")
    if gcc is None:
        pytest.skip("no gcc")
    src = Path(__file__).resolve().parents[2] / "scripts/testenv/src/nmeter.c"
    exe = tmp_path / "nmeter"
    subprocess.run([gcc, "-O2", "-o", str(exe), str(src)], check=True)
    line = subprocess.run(
        f"{exe} -d0 '%3t' | head -n1", shell=True, capture_output=True, text=True, timeout=30, check=True
    ).stdout
    assert re.fullmatch(r"\d\d:\d\d:\d\d\.\d{3}\n", line), line
    stamp = subprocess.run(
        ["sh", "-c", f"date -u +%FT$({exe} -d0 '%3t' | head -n1)Z"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    parsed = datetime.datetime.fromisoformat(stamp.replace("Z", "+00:00"))
    assert abs((parsed - datetime.datetime.now(datetime.UTC)).total_seconds()) < 60
    # Text around the field is kept; a bad command line is an error, as nmeter's.
    one = subprocess.run(
        f"{exe} -d0 't=%1t!' | head -n1", shell=True, capture_output=True, text=True, timeout=30, check=True
    ).stdout
    assert re.fullmatch(r"t=\d\d:\d\d:\d\d\.\d!\n", one), one
    bad = subprocess.run([str(exe)], capture_output=True, text=True, timeout=5)
    assert bad.returncode == 1 and "usage" in bad.stderr


def test_a_fake_shim_finds_only_the_images_of_the_mirrors_list(tmp_path: Path) -> None:
    agnhost = "registry.k8s.io/e2e-test-images/agnhost:2.56"
    listing = tmp_path / "e2e-images.txt"
    listing.write_text(f"# node e2e stand-ins\n{agnhost}\n\n{suite.PAUSE}  \n# not provided: perl\n")
    images = suite.available_images(listing)
    assert images == [agnhost, suite.PAUSE, suite.BUSYBOX]
    assert suite.available_images(tmp_path / "absent") is None

    h = types.SimpleNamespace(
        transport="grpcio", pause=suite.PAUSE, dir=tmp_path, cni=None, handler="fake", available_images=images
    )
    config = shim.config.load(shim_config(typing.cast(Harness, h)))
    assert config.handlers["fake"].options["available_images"] == images
    h.available_images = None  # no list: the fake's defaults, every image found
    assert "available_images" not in Path(shim_config(typing.cast(Harness, h))).read_text()
