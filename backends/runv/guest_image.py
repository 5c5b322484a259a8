"""The guest of the qemu driver: a kernel and an initramfs built from Debian packages.

``python -m backends.runv.guest_image --out DIR`` (or ``scripts/runv-guest``) downloads the
packages with ``apt-get download`` (no other download), unpacks them and writes

- ``DIR/vmlinuz``: the kernel of Debian's ``linux-image-amd64`` (the generic flavour: the
  cloud one has no 9p);
- ``DIR/initrd.img``: an uncompressed newc cpio (under TCG, decompressing in the guest costs
  more than reading a larger file) holding busybox, Python 3.11 and its standard library,
  runc, the C libraries they need, the kernel modules of the devices the VM has (virtio-mmio,
  virtio-serial, virtio-net, 9p, virtio-fs, overlayfs) and ``/init``;
- ``DIR/manifest.json``: the kernel release and the package versions.

``--criu`` adds Debian's ``criu`` and the libraries it links (for ``runc checkpoint`` and
``runc restore`` in the guest: runv's checkpoints, ``backends/runv/checkpoint.py``), written by
default to ``/var/lib/cri-shim/runv-guest-criu``, the image of a qemu handler with ``criu =
true``; off by default (its initramfs is 13 MiB larger, RAM in every VM).

The agent's code is not in it: the driver appends it as a second cpio at boot (the kernel
unpacks concatenated archives), so the image does not go stale when the agent changes.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Iterator

DEFAULT_OUT = "/var/lib/cri-shim/runv-guest"
DEFAULT_CRIU_OUT = "/var/lib/cri-shim/runv-guest-criu"  # of ``--criu`` (``[qemu] criu = true``)

# What the guest runs: busybox (init, mount, ip, insmod), Python and runc, and their libraries.
PACKAGES = [
    "busybox-static",
    "python3.11-minimal",
    "libpython3.11-minimal",
    "libpython3.11-stdlib",
    "runc",
    "libc6",
    "libseccomp2",
    "zlib1g",
    "libexpat1",
    "libffi8",
]

# With ``--criu``: CRIU (which runc execs for checkpoint and restore) and what it links. Its
# Python (crit, python3-protobuf) is left out: runc speaks to ``criu swrk`` itself.
CRIU_PACKAGES = [
    "criu",
    "libbsd0",
    "libmd0",
    "libgnutls30",
    "libp11-kit0",
    "libidn2-0",
    "libunistring2",
    "libtasn1-6",
    "libnettle8",
    "libhogweed6",
    "libgmp10",
    "libnftables1",
    "libmnl0",
    "libnftnl11",
    "libxtables12",
    "libjansson4",
    "libprotobuf-c1",
    "libnl-3-200",
    "libnet1",
    # GNU tar: criu saves and restores a container's tmpfs mounts (/dev, /dev/shm) with options
    # busybox's tar lacks.
    "tar",
    "libacl1",
    "libselinux1",
    "libpcre2-8-0",
]

# Kernel modules the VM's devices and the agent need, loaded in dependency order.
MODULES = [
    "virtio_pci",
    "virtio_mmio",
    "virtio_console",
    "virtio_net",
    "virtio_rng",
    "9pnet_virtio",
    "9p",
    "virtiofs",  # the shares over virtio-fs (runv.sharefs=virtiofs), else 9p
    "overlay",
    "bridge",  # brctl in containers: critest's privileged and NET_ADMIN specs
]

# With ``--criu``: what ``criu`` probes at start (its kerndat) and dumps sockets through.
CRIU_MODULES = [
    "unix_diag",
    "inet_diag",
    "tcp_diag",
    "udp_diag",
    "raw_diag",
    "netlink_diag",
    "af_packet_diag",
    "tun",
    "veth",
    "autofs4",
    "crc32c_generic",  # libcrc32c's soft dependency (modinfo names no hard one)
    "nf_tables",
]

# Parts of Python's standard library a headless agent never imports.
PYTHON_UNUSED = [
    "test",
    "idlelib",
    "tkinter",
    "turtledemo",
    "ensurepip",
    "pydoc_data",
    "lib2to3",
    "distutils",
    "unittest",
    "sqlite3",
    "venv",
    "email",
    "xml",
    "http",
    "xmlrpc",
    "curses",
    "dbm",
    "wsgiref",
    "turtle.py",
    "_pydecimal.py",
    "pydoc.py",
    "config-3.11-x86_64-linux-gnu",
]

# Codecs Python needs to start and the agent uses; the rest of ``encodings`` goes.
ENCODINGS_KEPT = {
    "__init__.py",
    "aliases.py",
    "utf_8.py",
    "utf_8_sig.py",
    "ascii.py",
    "latin_1.py",
    "idna.py",
}

INIT = r"""#!/bin/busybox sh
# runv guest init: mount the basics, load the device modules, mount the host's shares, then
# become the agent (PID 1). Everything printed goes to the console the host keeps.
/bin/busybox --install -s /bin
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
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
for m in $(cat /etc/runv/modules); do
    insmod "/lib/modules/$m" || echo "runv-init: cannot load $m"
done
arg() { for w in $(cat /proc/cmdline); do case $w in "$1"=*) echo "${w#*=}";; esac; done; }
[ "$(arg runv.fail_boot)" = 1 ] && { echo "runv-init: injected boot failure"; exit 1; }
shares=$(arg runv.shares)
mkdir -p "$shares"
if [ "$(arg runv.sharefs)" = virtiofs ]; then
    mount -t virtiofs shares "$shares"
else
    mount -t 9p -o trans=virtio,version=9p2000.L,msize=262144,cache=none,access=any shares "$shares"
fi || { echo "runv-init: cannot mount the shares"; exit 1; }
port=
for n in /sys/class/virtio-ports/*; do
    [ "$(cat "$n/name" 2>/dev/null)" = runv.agent ] && port=/dev/${n##*/}
done
[ -n "$port" ] || { echo "runv-init: no agent port"; exit 1; }
ip link set lo up
echo "runv-init: starting the agent on $port at $(cut -d' ' -f1 /proc/uptime) s"
export PYTHONPATH=/opt/runv PYTHONDONTWRITEBYTECODE=1
exec /usr/bin/python3.11 -m backends.runv.agent --serial "$port" --state /run/runv \
    --cgroup-parent /runv --runc /usr/sbin/runc
"""

# With ``--criu``, first: pivot_root refuses a root on the initramfs, and CRIU's restore of a
# container's mount namespace calls it; a bind mount of the root moved over / and chrooted
# into (as runc's --no-pivot does) has a parent mount, so the restore can pivot.
INIT_CRIU_ROOT = r"""if [ "$RUNV_ROOT" != moved ]; then
    /bin/busybox mkdir -p /newroot && /bin/busybox mount --bind / /newroot && cd /newroot \
        && /bin/busybox mount --move . / && RUNV_ROOT=moved exec /bin/busybox chroot . /init
    echo "runv-init: cannot move the root off the initramfs"
fi
unset RUNV_ROOT
"""


def init_script(criu: bool = False) -> str:
    """The guest's /init (with ``criu``: run again from a root CRIU's restore can pivot from)."""
    if not criu:
        return INIT
    lines = INIT.split("\n", 3)  # the shebang and the comment, then the rest
    return "\n".join(lines[:3]) + "\n" + INIT_CRIU_ROOT + lines[3]


# ---------------------------------------------------------------------------- cpio (newc)
def _cpio_header(name: bytes, mode: int, size: int, ino: int, nlink: int = 1, mtime: int = 0) -> bytes:
    fields = [ino, mode, 0, 0, nlink, mtime, size, 0, 0, 0, 0, len(name) + 1, 0]
    head = b"070701" + b"".join(b"%08X" % f for f in fields) + name + b"\0"
    return head + b"\0" * (-len(head) % 4)


def cpio_entries(root: str) -> Iterator[tuple[str, str]]:
    """(archive name, path) of everything under ``root``, parents before children."""
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(dirnames) + sorted(filenames):
            path = os.path.join(dirpath, name)
            yield os.path.relpath(path, root), path


def write_cpio(out: str, entries: Iterable[tuple[str, str]]) -> None:
    """A newc archive of ``entries`` (directories, files, symlinks), owned by root."""
    with open(out, "wb") as fh:
        ino = 1
        for name, path in entries:
            st = os.lstat(path)
            ino += 1
            if stat.S_ISLNK(st.st_mode):
                data = os.readlink(path).encode()
            elif stat.S_ISREG(st.st_mode):
                with open(path, "rb") as src:
                    data = src.read()
            elif stat.S_ISDIR(st.st_mode):
                data = b""
            else:
                continue  # no device nodes: devtmpfs makes them
            fh.write(_cpio_header(name.encode(), st.st_mode, len(data), ino, 2 if data == b"" else 1))
            fh.write(data + b"\0" * (-len(data) % 4))
        fh.write(_cpio_header(b"TRAILER!!!", 0, 0, 0))


def write_cpio_files(out: str, files: dict[str, bytes]) -> None:
    """A newc archive of in-memory files (name -> content), with their parent directories."""
    with open(out, "wb") as fh:
        ino = 1
        seen: set[str] = set()
        for name in sorted(files):
            parts = name.split("/")
            for i in range(1, len(parts)):
                parent = "/".join(parts[:i])
                if parent not in seen:
                    seen.add(parent)
                    ino += 1
                    fh.write(_cpio_header(parent.encode(), stat.S_IFDIR | 0o755, 0, ino, 2))
            data = files[name]
            ino += 1
            fh.write(_cpio_header(name.encode(), stat.S_IFREG | 0o644, len(data), ino))
            fh.write(data + b"\0" * (-len(data) % 4))
        fh.write(_cpio_header(b"TRAILER!!!", 0, 0, 0))


# ---------------------------------------------------------------------------- building
def _run(argv: list[str], cwd: str | None = None) -> str:
    res = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, check=False)
    if res.returncode != 0:
        raise SystemExit(f"runv-guest: {' '.join(argv)} failed: {res.stderr.strip() or res.stdout.strip()}")
    return res.stdout


def kernel_package() -> str:
    """The versioned package ``linux-image-amd64`` stands for (linux-image-6.1.0-N-amd64)."""
    for line in _run(["apt-cache", "depends", "linux-image-amd64"]).splitlines():
        line = line.strip()
        if line.startswith("Depends: linux-image-"):
            return line.split()[1]
    raise SystemExit("runv-guest: apt-cache names no kernel for linux-image-amd64 (apt-get update?)")


def download(packages: list[str], cache: str) -> list[str]:
    os.makedirs(cache, exist_ok=True)
    os.chmod(cache, 0o755)
    have = {f.split("_")[0]: f for f in os.listdir(cache) if f.endswith(".deb")}
    missing = [p for p in packages if p not in have]
    if missing:
        _run(["apt-get", "download", *missing], cwd=cache)
    have = {f.split("_")[0]: f for f in os.listdir(cache) if f.endswith(".deb")}
    return [os.path.join(cache, have[p]) for p in packages]


def _modinfo_depends(path: str) -> list[str]:
    with open(path, "rb") as fh:
        data = fh.read()
    at = data.find(b"\0depends=")
    if at < 0:
        return []
    value = data[at + 9 : data.index(b"\0", at + 1)].decode()
    return [d for d in value.split(",") if d]


def module_order(modules_root: str, wanted: list[str]) -> list[str]:
    """Paths (relative to ``modules_root``) of ``wanted`` and what they depend on, dependencies first."""
    by_name: dict[str, str] = {}
    for dirpath, _dirs, files in os.walk(modules_root):
        for f in files:
            if f.endswith(".ko"):
                by_name[f[:-3].replace("-", "_")] = os.path.relpath(os.path.join(dirpath, f), modules_root)
    order: list[str] = []

    def visit(name: str, stack: tuple[str, ...]) -> None:
        name = name.replace("-", "_")
        rel = by_name.get(name)
        if rel is None:
            return  # built into the kernel
        if rel in order or name in stack:
            return
        for dep in _modinfo_depends(os.path.join(modules_root, rel)):
            visit(dep, (*stack, name))
        order.append(rel)

    for name in wanted:
        if name.replace("-", "_") not in by_name:
            raise SystemExit(f"runv-guest: the kernel has no module {name}")
        visit(name, ())
    return order


def _trim_python(lib: str) -> None:
    for name in PYTHON_UNUSED:
        path = os.path.join(lib, name)
        if os.path.isdir(path):
            shutil.rmtree(path)
        elif os.path.exists(path):
            os.unlink(path)
    enc = os.path.join(lib, "encodings")
    for name in os.listdir(enc):
        if name not in ENCODINGS_KEPT:
            path = os.path.join(enc, name)
            shutil.rmtree(path) if os.path.isdir(path) else os.unlink(path)


def _drop_sources(lib: str) -> None:
    """Keep ``x.pyc`` beside where ``x.py`` was (sourceless imports), drop the sources and caches."""
    for dirpath, dirnames, filenames in os.walk(lib):
        if "__pycache__" in dirnames:
            shutil.rmtree(os.path.join(dirpath, "__pycache__"))
            dirnames.remove("__pycache__")
        for f in filenames:
            if f.endswith(".py") and os.path.exists(os.path.join(dirpath, f + "c")):
                os.unlink(os.path.join(dirpath, f))


def build(out: str, cache: str, criu: bool = False) -> dict[str, object]:
    kpkg = kernel_package()
    debs = download([kpkg, *PACKAGES, *(CRIU_PACKAGES if criu else [])], cache)
    with tempfile.TemporaryDirectory(prefix="runv-guest-") as tmp:
        kroot = os.path.join(tmp, "kernel")
        root = os.path.join(tmp, "root")
        _run(["dpkg-deb", "-x", debs[0], kroot])
        for deb in debs[1:]:
            _run(["dpkg-deb", "-x", deb, root])
        release = kpkg.removeprefix("linux-image-")
        for sub in ("usr/share", "usr/lib/x86_64-linux-gnu/gconv"):
            shutil.rmtree(os.path.join(root, sub), ignore_errors=True)
        _trim_python(os.path.join(root, "usr/lib/python3.11"))
        mods_src = os.path.join(kroot, "lib/modules", release)
        if not os.path.isdir(mods_src):
            mods_src = os.path.join(kroot, "usr/lib/modules", release)
        order = module_order(mods_src, MODULES + (CRIU_MODULES if criu else []))
        for rel in order:
            dst = os.path.join(root, "lib/modules", rel)
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            shutil.copy2(os.path.join(mods_src, rel), dst)
        os.makedirs(os.path.join(root, "etc/runv"), exist_ok=True)
        with open(os.path.join(root, "etc/runv/modules"), "w") as fh:
            fh.write("\n".join(order) + "\n")
        for d in ("proc", "sys", "dev", "run", "tmp", "etc", "root", "opt/runv", "var/tmp"):
            os.makedirs(os.path.join(root, d), exist_ok=True)
        with open(os.path.join(root, "etc/passwd"), "w") as fh:
            fh.write("root:x:0:0:root:/root:/bin/sh\n")
        with open(os.path.join(root, "etc/group"), "w") as fh:
            fh.write("root:x:0:\n")
        init = os.path.join(root, "init")
        with open(init, "w") as fh:
            fh.write(init_script(criu))
        os.chmod(init, 0o755)
        # Bytecode once here rather than at every boot, by the guest's own Python in a chroot
        # of the tree (which also shows that its libraries resolve), and only bytecode: under
        # emulation every byte of the initramfs costs boot time.
        _run(["chroot", root, "/usr/bin/python3.11", "-m", "compileall", "-q", "-b", "/usr/lib/python3.11"])
        _drop_sources(os.path.join(root, "usr/lib/python3.11"))
        _run(["chroot", root, "/usr/bin/python3.11", "-c", "import asyncio, ctypes, json, termios"])
        _run(["chroot", root, "/usr/sbin/runc", "--version"])
        if criu:
            _run(["chroot", root, "/usr/sbin/criu", "--version"])
            _run(["chroot", root, "/bin/tar", "--version"])
        os.makedirs(out, exist_ok=True)
        vmlinuz = os.path.join(kroot, "boot", f"vmlinuz-{release}")
        shutil.copyfile(vmlinuz, os.path.join(out, "vmlinuz.tmp"))
        write_cpio(os.path.join(out, "initrd.img.tmp"), cpio_entries(root))
        manifest: dict[str, object] = {
            "recipe": recipe(criu),
            "criu": criu,
            "kernel": release,
            "packages": [os.path.basename(d) for d in debs],
            "modules": order,
        }
        os.replace(os.path.join(out, "vmlinuz.tmp"), os.path.join(out, "vmlinuz"))
        os.replace(os.path.join(out, "initrd.img.tmp"), os.path.join(out, "initrd.img"))
        with open(os.path.join(out, "manifest.json"), "w") as fh:
            json.dump(manifest, fh, indent=1)
    return manifest


def recipe(criu: bool = False) -> str:
    """What the image is built from, as a digest: an image of another recipe is rebuilt."""
    parts = [PACKAGES, MODULES, PYTHON_UNUSED, sorted(ENCODINGS_KEPT), INIT]
    if criu:
        parts += [CRIU_PACKAGES, CRIU_MODULES, INIT_CRIU_ROOT]
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:16]


def current(out: str, criu: bool = False) -> bool:
    """Whether ``out`` holds an image of this recipe."""
    try:
        with open(os.path.join(out, "manifest.json")) as fh:
            built = json.load(fh).get("recipe")
    except (OSError, ValueError):
        return False
    return built == recipe(criu) and all(
        os.path.exists(os.path.join(out, f)) for f in ("vmlinuz", "initrd.img")
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="runv-guest", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--out", help=f"where to write the image (default {DEFAULT_OUT}; with --criu {DEFAULT_CRIU_OUT})"
    )
    parser.add_argument("--cache", help="where downloaded packages are kept (default OUT/debs)")
    parser.add_argument(
        "--if-missing", action="store_true", help="do nothing when OUT has an image of this recipe"
    )
    parser.add_argument(
        "--criu", action="store_true", help="also CRIU, for runc checkpoint/restore in the guest"
    )
    ns = parser.parse_args(argv)
    out = os.path.abspath(ns.out or (DEFAULT_CRIU_OUT if ns.criu else DEFAULT_OUT))
    if ns.if_missing and current(out, ns.criu):
        return 0
    manifest = build(out, ns.cache or os.path.join(out, "debs"), ns.criu)
    size = os.path.getsize(os.path.join(out, "initrd.img")) // (1024 * 1024)
    print(f"runv-guest: kernel {manifest['kernel']}, initrd {size} MiB in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
