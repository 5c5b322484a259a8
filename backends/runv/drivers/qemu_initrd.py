"""The qemu driver's initramfs: the guest image's, with the agent's code appended.

The guest's kernel and base initramfs are built by ``backends.runv.guest_image``
(``scripts/runv-guest``); the agent (``backends/runv/agent`` and what it imports) is a second
cpio appended to that initramfs, made here once per content of both.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import marshal
import os
import shutil
import sys

from backends.runv import guest_image
from backends.runv.drivers.base import package_root

# The agent's code and what it imports, appended to the initramfs under /opt/runv.
AGENT_FILES = [
    "backends/__init__.py",
    "backends/contract/__init__.py",
    "backends/contract/usage.py",
    "backends/contract/errors.py",
    "backends/linux/*.py",
    "backends/runv/agent/*.py",
]


def agent_files() -> dict[str, bytes]:
    """The agent's sources (and, on a 3.11 host, their bytecode) as archive name -> content."""
    root = package_root()
    files: dict[str, bytes] = {"opt/runv/backends/runv/__init__.py": b""}
    names: list[str] = []
    for pattern in AGENT_FILES:
        if pattern.endswith("*.py"):
            d = os.path.join(root, os.path.dirname(pattern))
            names += [
                os.path.join(os.path.dirname(pattern), f) for f in sorted(os.listdir(d)) if f.endswith(".py")
            ]
        else:
            names.append(pattern)
    # The guest's Python is 3.11: bytecode compiled here saves it compiling at every boot,
    # and it falls back to the sources if the magic ever differs.
    same = sys.version_info[:2] == (3, 11)
    for name in names:
        with open(os.path.join(root, name), "rb") as fh:
            source = fh.read()
        files["opt/runv/" + name] = source
        if same:
            code = compile(source, "/opt/runv/" + name, "exec", dont_inherit=True)
            # An unchecked hash-based pyc (PEP 552): valid whatever the file times in the archive.
            pyc = importlib.util.MAGIC_NUMBER + (1).to_bytes(4, "little")
            pyc += importlib.util.source_hash(source) + marshal.dumps(code)
            base = os.path.basename(name)[:-3]
            cache = f"opt/runv/{os.path.dirname(name)}/__pycache__/{base}.{sys.implementation.cache_tag}.pyc"
            files[cache] = pyc
    return files


def agent_initrd(base: str, run_dir: str) -> str:
    """The base initramfs ``base`` with the agent appended, in ``run_dir``: made once per
    content (earlier agents' images there are removed)."""
    files = agent_files()
    digest = hashlib.sha256()
    st = os.stat(base)
    digest.update(f"{base}:{st.st_size}:{st.st_mtime_ns}".encode())
    for name in sorted(files):
        digest.update(name.encode() + b"\0" + files[name])
    path = os.path.join(run_dir, f"initrd-{digest.hexdigest()[:16]}.img")
    if not os.path.exists(path):
        os.makedirs(run_dir, exist_ok=True)
        agent = path + ".agent"
        guest_image.write_cpio_files(agent, files)
        tmp = path + ".tmp"
        with open(tmp, "wb") as out:
            for part in (base, agent):
                with open(part, "rb") as src:
                    shutil.copyfileobj(src, out, 1 << 20)
        os.replace(tmp, path)
        os.unlink(agent)
        for old in os.listdir(run_dir):  # earlier agents' images
            if old.startswith("initrd-") and os.path.join(run_dir, old) != path:
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(run_dir, old))
    return path
