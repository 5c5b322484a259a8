"""Issue 43's probe: does CRIU work inside the qemu driver's guest (runc checkpoint/restore)?

Boots the guest image built with ``scripts/runv-guest --criu --out DIR`` under QEMU by hand
(no agent: a second cpio puts a probe init in place of the agent), runs ``criu check``, then
for each case a busybox container counting once a second, started by ``runc run -d`` as the
agent starts its containers (``--no-pivot``: the root is the initramfs; stdout a pipe), is
checkpointed with ``--leave-running``, killed, restored, and must go on counting from where it
was. Prints one JSON line per step with its output and seconds.

    python -m bench.criu_probe [--guest DIR] [--case NAME ...]

Cases: ``dir`` (rootfs a directory of the initramfs), ``overlay`` (an overlay on tmpfs, as the
agent mounts a container's layers), ``share`` (the same with the lower layer on a 9p export of
the host, as the agent's layers are), ``podpid`` (the container joins a PID namespace made
before it, by path, as the agent's pod containers do).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

from backends.runv import guest_image

DEFAULT_GUEST = guest_image.DEFAULT_CRIU_OUT
CASES = ("dir", "overlay", "share", "podpid")

INIT = r"""#!/bin/busybox sh
/bin/busybox --install -s /bin
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
# pivot_root refuses a root on the initramfs (CRIU's restore of a mount namespace calls it):
# a bind mount of it moved over / and chrooted into, as runc's --no-pivot does, has a parent.
if [ "$PROBE_ROOT" != moved ] && grep -q "^probe.root=bind" /proc/cmdline 2>/dev/null     || { [ "$PROBE_ROOT" != moved ] && mount -t proc proc /proc && grep -q "probe.root=bind" /proc/cmdline          && umount /proc; }; then
    mkdir -p /newroot && mount --bind / /newroot && cd /newroot && mount --move . /         && PROBE_ROOT=moved exec chroot . /probe-init
    echo "probe: cannot move the root"
fi
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs dev /dev 2>/dev/null
mkdir -p /dev/pts /dev/shm /dev/mqueue /run /tmp /sys/fs/cgroup
mount -t devpts devpts /dev/pts -o newinstance,ptmxmode=0666
mount -t tmpfs shm /dev/shm -o mode=1777
mount -t mqueue mqueue /dev/mqueue
mount -t tmpfs run /run -o mode=755
mount -t tmpfs tmp /tmp -o mode=1777
mount -t cgroup2 cgroup2 /sys/fs/cgroup
echo "+cpu +memory +pids +io +cpuset" > /sys/fs/cgroup/cgroup.subtree_control 2>/dev/null
for m in $(cat /etc/runv/modules); do insmod "/lib/modules/$m" || echo "probe: cannot load $m"; done
ip link set lo up
mkdir -p /run/share
mount -t 9p -o trans=virtio,version=9p2000.L,msize=262144,cache=none,access=any shares /run/share \
    || echo "probe: no 9p share"
/usr/bin/python3.11 /probe.py
echo "PROBE-END"
poweroff -f
"""

GUEST = r'''
import ctypes, json, os, subprocess, sys, time

# The probe reaps orphans, as the agent does: a zombie would keep its PID from a restore.
ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER


def reap():
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return

RUNC = ["runc", "--root", "/run/runc"]
CASES = sys.argv[1:] or %(cases)r


def report(step, **kw):
    print("PROBE " + json.dumps({"step": step, **kw}), flush=True)


def run(step, argv, **kw):
    t = time.monotonic()
    res = subprocess.run(argv, capture_output=True, text=True, **kw)
    report(step, argv=argv, rc=res.returncode, seconds=round(time.monotonic() - t, 3),
           out=res.stdout[-4000:], err=res.stderr[-4000:])
    return res


def tail(path, n=40):
    """The last lines of a log, or of a CRIU log the lines around its first error."""
    try:
        with open(path) as fh:
            lines = fh.readlines()
    except OSError as exc:
        return str(exc)
    first = next((i for i, line in enumerate(lines) if "Error" in line), None)
    if first is not None:
        return "".join(lines[max(0, first - 15) : first + 10])
    return "".join(lines[-n:])


def rootfs_tree(root):
    for d in ("bin", "proc", "sys", "dev", "tmp", "etc"):
        os.makedirs(os.path.join(root, d), exist_ok=True)
    subprocess.run(["cp", "/bin/busybox", os.path.join(root, "bin/busybox")], check=True)
    for name in ("sh", "sleep", "echo", "cat"):
        os.symlink("busybox", os.path.join(root, "bin", name))


def config(bundle, rootfs, pid_ns=""):
    if os.path.exists(os.path.join(bundle, "config.json")):
        os.unlink(os.path.join(bundle, "config.json"))
    subprocess.run(RUNC[:1] + ["spec", "--bundle", bundle], check=True)
    with open(os.path.join(bundle, "config.json")) as fh:
        c = json.load(fh)
    c["process"]["terminal"] = False
    c["process"]["args"] = ["sh", "-c", "i=0; while true; do echo $i; i=$((i+1)); sleep 1; done"]
    c["root"] = {"path": rootfs, "readonly": False}
    c.pop("hostname", None)
    # As the agent's containers: the VM's network, IPC and UTS; a mount and a PID namespace.
    ns = [{"type": "mount"}, {"type": "pid", "path": pid_ns} if pid_ns else {"type": "pid"}]
    c["linux"]["namespaces"] = ns
    c["linux"]["cgroupsPath"] = "/runv/ctr"
    c["mounts"] = [m for m in c["mounts"] if m["destination"] not in ("/sys", "/sys/fs/cgroup")]
    with open(os.path.join(bundle, "config.json"), "w") as fh:
        json.dump(c, fh)


def start_counter(step, argv, log):
    """runc ARGV with stdout a pipe read into LOG (as the agent reads its containers'), and its time."""
    # Pipes for stdout and stderr, as the agent gives (a file outside the container's mounts
    # could not be dumped); what runc itself says goes to stderr too.
    errlog = log + ".err"
    t = time.monotonic()
    reader = subprocess.Popen(["cat"], stdin=subprocess.PIPE, stdout=open(log, "ab"))
    ereader = subprocess.Popen(["cat"], stdin=subprocess.PIPE, stdout=open(errlog, "ab"))
    res = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=reader.stdin, stderr=ereader.stdin)
    reader.stdin.close()
    ereader.stdin.close()
    time.sleep(0.2)
    report(step, argv=argv, rc=res.returncode, seconds=round(time.monotonic() - t, 3), err=tail(errlog))
    return res.returncode == 0


def numbers(log):
    with open(log) as fh:
        return [int(x) for x in fh.read().split() if x.isdigit()]


def pod_pid_ns():
    """A PID namespace held by a sleeping PID 1, as the agent's pod init holds a pod's."""
    holder = subprocess.Popen(["unshare", "-p", "-f", "sleep", "100000"])
    for _ in range(100):
        kids = open(f"/proc/{holder.pid}/task/{holder.pid}/children").read().split()
        if kids:
            break
        time.sleep(0.05)
    return f"/proc/{kids[0]}/ns/pid"


def case(name):
    base = f"/run/probe/{name}"
    bundle, rootfs = base + "/bundle", base + "/bundle/rootfs"
    os.makedirs(rootfs, exist_ok=True)
    pid_ns = ""
    if name == "dir":
        rootfs_tree(rootfs)
    elif name in ("overlay", "share", "podpid"):
        lower = "/run/share/lower" if name == "share" else base + "/lower"
        if name == "share" and not os.path.isdir(lower):
            report(name + ":skip", why="no 9p share with lower/")
            return
        if name != "share":
            rootfs_tree(lower)
        for d in ("upper", "work"):
            os.makedirs(os.path.join(base, d), exist_ok=True)
        opts = f"lowerdir={lower},upperdir={base}/upper,workdir={base}/work"
        subprocess.run(["mount", "-t", "overlay", "overlay", "-o", opts, rootfs], check=True)
    if name == "podpid":
        pid_ns = pod_pid_ns()
    config(bundle, rootfs, pid_ns)
    cid = "ctr-" + name
    log1, log2 = base + "/out1.log", base + "/out2.log"
    if not start_counter(name + ":run", RUNC + ["run", "-d", "--no-pivot", "--bundle", bundle, cid], log1):
        return
    time.sleep(4)
    img, work = base + "/img", base + "/work-ckpt"
    res = run(name + ":checkpoint", RUNC + ["checkpoint", "--leave-running", "--image-path", img,
                                            "--work-path", work, cid])
    if res.returncode != 0:
        report(name + ":dump.log", log=tail(work + "/dump.log"))
        run(name + ":delete", RUNC + ["delete", "--force", cid])
        return
    du = subprocess.run(["du", "-sk", img], capture_output=True, text=True).stdout.split()[0]
    report(name + ":image", kib=int(du), files=sorted(os.listdir(img)))
    time.sleep(2)
    # Every process of the container gone (in a PID namespace not its own, runc's delete kills
    # its init only), so that the restored ones get their PIDs back.
    with open("/sys/fs/cgroup/runv/ctr/cgroup.kill", "w") as fh:
        fh.write("1")
    time.sleep(0.5)
    reap()
    run(name + ":delete", RUNC + ["delete", "--force", cid])
    if pid_ns:
        target = os.readlink(pid_ns)
        inside = []
        for p in os.listdir("/proc"):
            try:
                if p.isdigit() and os.readlink(f"/proc/{p}/ns/pid") == target:
                    status = open(f"/proc/{p}/status").read()
                    nspid = [line for line in status.splitlines() if line.startswith(("NSpid", "State", "Name"))]
                    inside.append(nspid)
            except OSError:
                pass
        report(name + ":pod-ns-before-restore", processes=inside)
    if name == "podpid" and os.environ.get("PROBE_FRESH_PIDNS", "1") == "1":
        # Restored into a new pod PID namespace, as a RestorePod into a new VM would. (In the
        # old one the dumped init's PID stays taken: killed, it is a zombie of the holder,
        # a sleep that never reaps; the agent's pod init reaps, and there a restore in the
        # same namespace works: tests/runv/test_qemu_criu_probe.py.)
        pid_ns = pod_pid_ns()
        config(bundle, rootfs, pid_ns)
        report(name + ":fresh-pod-ns", path=pid_ns)
    before = numbers(log1)
    report(name + ":counted-before", numbers=before)
    rwork = base + "/work-restore"
    ok = start_counter(name + ":restore", RUNC + ["restore", "-d", "--no-pivot", "--image-path", img,
                                                  "--work-path", rwork, "--bundle", bundle, cid], log2)
    if not ok:
        report(name + ":restore.log", log=tail(rwork + "/restore.log"))
        run(name + ":delete2", RUNC + ["delete", "--force", cid])
        return
    time.sleep(4)
    run(name + ":state", RUNC + ["state", cid])
    after = numbers(log2)
    report(name + ":counted-after", numbers=after)
    run(name + ":delete2", RUNC + ["delete", "--force", cid])


def main():
    run("criu-version", ["criu", "--version"])
    run("criu-check", ["criu", "check"])
    run("criu-check-all", ["criu", "check", "--all"])
    for name in CASES:
        try:
            case(name)
        except Exception as exc:
            report(name + ":error", error=repr(exc))


main()
'''


def probe(
    guest: str, cases: list[str], root_mode: str = "bind", timeout: float = 900
) -> list[dict[str, object]]:
    """Boot the guest with the probe, the steps it reported (in order)."""
    with tempfile.TemporaryDirectory(prefix="criu-probe-") as tmp:
        root = os.path.join(tmp, "root")
        os.makedirs(root)
        with open(os.path.join(root, "probe-init"), "w") as fh:
            fh.write(INIT)
        os.chmod(os.path.join(root, "probe-init"), 0o755)
        with open(os.path.join(root, "probe.py"), "w") as fh:
            fh.write(GUEST % {"cases": list(cases)})
        extra = os.path.join(tmp, "probe.cpio")
        guest_image.write_cpio(extra, guest_image.cpio_entries(root))
        initrd = os.path.join(tmp, "initrd.img")
        with open(initrd, "wb") as out:
            for part in (os.path.join(guest, "initrd.img"), extra):
                with open(part, "rb") as src:
                    shutil.copyfileobj(src, out)
        share = os.path.join(tmp, "share")
        lower = os.path.join(share, "lower")
        for d in ("bin", "proc", "sys", "dev", "tmp", "etc"):
            os.makedirs(os.path.join(lower, d))
        busybox = shutil.which("busybox") or "/bin/busybox"
        if os.path.exists(busybox):
            shutil.copy(busybox, os.path.join(lower, "bin/busybox"))
            for name in ("sh", "sleep", "echo", "cat"):
                os.symlink("busybox", os.path.join(lower, "bin", name))
        else:
            shutil.rmtree(lower)
        console = os.path.join(tmp, "console.log")
        argv = [
            "qemu-system-x86_64",
            *("-machine", "pc", "-accel", "tcg,tb-size=64", "-cpu", "max", "-smp", "2", "-m", "512M"),
            *("-nodefaults", "-no-user-config", "-display", "none", "-no-reboot"),
            *("-kernel", os.path.join(guest, "vmlinuz"), "-initrd", initrd),
            *(
                "-append",
                f"console=ttyS0 quiet panic=-1 reboot=t 8250.nr_uarts=1 rdinit=/probe-init probe.root={root_mode}",
            ),
            *("-chardev", f"file,id=console,path={console}", "-serial", "chardev:console"),
            *("-fsdev", f"local,id=shares,path={share},security_model=passthrough"),
            *("-device", "virtio-9p-pci,fsdev=shares,mount_tag=shares", "-device", "virtio-rng-pci"),
        ]
        t = time.monotonic()
        subprocess.run(argv, timeout=timeout, check=False, stdin=subprocess.DEVNULL)
        elapsed = time.monotonic() - t
        with open(console, errors="replace") as fh:
            text = fh.read()
    steps = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("PROBE {")]
    steps.append({"step": "vm", "seconds": round(elapsed, 1), "ended": "PROBE-END" in text})
    if "PROBE-END" not in text:
        steps.append({"step": "console", "tail": text[-4000:]})
    return steps


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--guest", default=DEFAULT_GUEST, help=f"the --criu guest image (default {DEFAULT_GUEST})"
    )
    parser.add_argument("--case", action="append", choices=CASES, help="cases to run (default all)")
    ns = parser.parse_args(argv)
    for step in probe(ns.guest, ns.case or list(CASES)):
        print(json.dumps(step))
    return 0


if __name__ == "__main__":
    sys.exit(main())
