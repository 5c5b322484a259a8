"""QEMU's confinement (the qemu driver's ``confine = true``): each QEMU as a user of its own.

- :data:`CONFINE`, the root shell run in QEMU's new mount (and network) namespace before it:
  the tap on CNI, a root of its own (``pivot_root`` onto a tmpfs holding only what QEMU
  reads), virtiofsd (``qemu_virtiofs.VIRTIOFSD``, when ``RUNV_VIRTIOFSD`` names it) or the 9p
  proxy (virtfs-proxy-helper) started on :data:`PROXY_SOCKET`, then QEMU
  exec'd by ``setpriv`` with no groups, no capabilities and no new privileges;
- :func:`confine_env`, what that script is told (the files, the state directory, the uid,
  the binaries);
- :func:`allocate_uid`, the VM's uid from the driver's range;
- :data:`SANDBOX`, QEMU's seccomp filter.
"""

from __future__ import annotations

import hashlib
import os
import shutil

from backends.contract.errors import ResourceExhaustedError
from backends.runv.drivers.qemu_virtiofs import VIRTIOFSD
from backends.runv.hypervisor import VM

PROXY_SOCKET = "9p.sock"  # the 9p proxy's socket in the VM's state directory
# QEMU's seccomp filter: no obsolete calls, no set*uid/set*gid, no fork/exec, no scheduler or
# resource-limit calls.
SANDBOX = "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny"

# Run in QEMU's new mount (and network) namespace, as root, before QEMU: a root of its own on a
# tmpfs with only /usr (read-only; /bin, /lib... as the host links them), the loader's cache,
# a /dev of null, zero, random, urandom, net/tun and kvm (those two made its user's), a /proc
# that shows it only its own processes (hidepid=invisible),
# the guest's kernel and initramfs (read-only) and the VM's state directory; then virtiofsd
# (its own namespace sandbox and seccomp, see qemu_virtiofs.py) or the 9p proxy
# (virtfs-proxy-helper: root with the file capabilities only, chrooted into the VM's shares
# directory) and QEMU, exec'd by setpriv as the VM's own uid and gid, no groups, no
# capabilities (bounding set emptied), no new privileges. QEMU 7.2's own -runas/-chroot cannot
# be used with elevateprivileges=deny (its seccomp filter is in place before it drops root,
# and the setuid is then killed).
CONFINE = (
    r"""
set -eu
u=$RUNV_UID st=$RUNV_STATE
if [ -n "$RUNV_TAP" ]; then
    "$RUNV_IP" tuntap add dev "$RUNV_TAP" mode tap user "$u" group "$u"
    "$RUNV_IP" link set dev "$RUNV_TAP" up
fi
r=$st/root
mkdir -p "$r"
mount -t tmpfs -o mode=0755,size=1m runv-root "$r"
mkdir "$r/usr" "$r/etc" "$r/dev" "$r/dev/net" "$r/proc"
mount --rbind /usr "$r/usr"
mount -o remount,bind,ro "$r/usr"
for d in bin sbin lib lib32 lib64 libx32; do
    if [ -L "/$d" ]; then ln -s "$(readlink "/$d")" "$r/$d"
    elif [ -d "/$d" ]; then mkdir "$r/$d"; mount --rbind "/$d" "$r/$d"; mount -o remount,bind,ro "$r/$d"
    fi
done
if [ -e /etc/ld.so.cache ]; then
    touch "$r/etc/ld.so.cache"; mount --bind /etc/ld.so.cache "$r/etc/ld.so.cache"
fi
for n in null zero random urandom; do touch "$r/dev/$n"; mount --bind "/dev/$n" "$r/dev/$n"; done
for n in net/tun kvm; do
    if [ -c "/dev/$n" ]; then
        mknod -m 0600 "$r/dev/$n" c "0x$(stat -c %t "/dev/$n")" "0x$(stat -c %T "/dev/$n")"
        chown "$u:$u" "$r/dev/$n"
    fi
done
mount -t proc -o nosuid,nodev,noexec,hidepid=invisible proc "$r/proc"
printf '%s
' "$RUNV_FILES" | while read -r f; do
    mkdir -p "$r$(dirname "$f")"; touch "$r$f"; mount --bind "$f" "$r$f"; mount -o remount,bind,ro "$r$f"
done
mkdir -p "$r$st"
mount --bind "$st" "$r$st"
cd "$r"
mkdir .old
pivot_root . .old
cd /
umount -l /.old
rmdir /.old
if [ -n "${RUNV_VIRTIOFSD:-}" ]; then
"""
    + VIRTIOFSD
    + r"""
else
rm -f "$st/9p.sock"
"$RUNV_PROXY" -p "$st/shares" -s "$st/9p.sock" -u "$u" -g "$u" -n 3<&- 4<&- &
i=0
while [ ! -S "$st/9p.sock" ]; do
    i=$((i + 1))
    if [ "$i" -gt 1000 ]; then echo "runv: the 9p proxy did not start" >&2; exit 98; fi
    sleep 0.01
done
fi
exec "$RUNV_SETPRIV" --reuid="$u" --regid="$u" --clear-groups --inh-caps=-all --bounding-set=-all \
    --no-new-privs -- "$@"
"""
)


def allocate_uid(uids: dict[str, int], vm_id: str, uid_base: int, uid_count: int) -> int:
    """A uid of the range no other VM in ``uids`` (VM id -> uid, the driver's) runs as (from a
    hash of the VM's ID), recorded there for ``vm_id``."""
    used = set(uids.values())
    start = int(hashlib.sha256(b"uid" + vm_id.encode()).hexdigest(), 16) % uid_count
    for i in range(uid_count):
        uid = uid_base + (start + i) % uid_count
        if uid not in used:
            uids[vm_id] = uid
            return uid
    raise ResourceExhaustedError(f"no free uid in {uid_base}+{uid_count} for a QEMU")


def confine_env(
    vm: VM, argv: list[str], tap: str, proxy_helper: str, setpriv: str, ip: str
) -> dict[str, str]:
    """What CONFINE needs: the files QEMU reads (its binary when it is not under /usr, the
    guest's kernel and initramfs), its state directory, user, tap and the 9p proxy."""
    files = [argv[argv.index(flag) + 1] for flag in ("-kernel", "-initrd")]
    binary = os.path.realpath(shutil.which(argv[0]) or argv[0])
    if not binary.startswith("/usr/"):
        files.append(binary)
    return {
        "RUNV_UID": str(vm.uid),
        "RUNV_STATE": vm.state_dir,
        "RUNV_FILES": "\n".join(os.path.realpath(f) for f in files),
        "RUNV_TAP": tap,
        "RUNV_PROXY": proxy_helper,
        "RUNV_SETPRIV": setpriv,
        "RUNV_IP": ip,
    }
