"""A layer's bytes into a snapshot directory, as they arrive: decompression, the diff ID, and a
tar reader that writes each file straight from the decompressed buffers.

:class:`Unpacker` is fed the layer blob (compressed or not) in chunks of any size and
extracts as it goes; :meth:`Unpacker.finish` returns the diff ID (sha256 of the tar). It keeps
the archive's paths inside the snapshot (no ``..``, no write through a symlink that leads
out) and writes whiteouts in overlayfs form: ``.wh.NAME`` a 0/0 character device,
``.wh..wh..opq`` the ``trusted.overlay.opaque`` xattr of its directory.

Why not :mod:`tarfile`: in stream mode it reads through 10 KiB records and copies each file in
16 KiB pieces, and an extraction call costs a dozen syscalls; here a file is ``open``, one
``write`` per decompressed buffer, ``fchown``/``fchmod``/``utime``, ``close``. Headers are still
parsed by :meth:`tarfile.TarInfo.frombuf` (checksums, base-256 numbers, ustar prefixes).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import tarfile
from collections.abc import Iterator
from typing import IO, Any, cast

from backends.oci.registry import PullError

try:  # zlib-ng inflates about 3x as fast as zlib (bench/pull_bench.py); the same API
    from zlib_ng import zlib_ng as zlib
except ImportError:  # pragma: no cover (a platform without its wheel)
    import zlib  # type: ignore[no-redef]
_ZLIB_ERROR = cast(type[Exception], zlib.error)  # zlib-ng's stub calls it an instance

WHITEOUT = ".wh."
OPAQUE = ".wh..wh..opq"
BLOCK = 512
# One decompression call's output at most: bounds memory on a highly compressible layer.
OUT_CHUNK = 4 * 1024 * 1024
GZIP_MAGIC = b"\x1f\x8b"
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
_ROOT = os.geteuid() == 0
_ZEROS = bytes(BLOCK)
_XATTR = "SCHILY.xattr."
_NODES = {tarfile.CHRTYPE: stat.S_IFCHR, tarfile.BLKTYPE: stat.S_IFBLK, tarfile.FIFOTYPE: stat.S_IFIFO}
_META_TYPES = (
    tarfile.XHDTYPE,
    tarfile.XGLTYPE,
    tarfile.SOLARIS_XHDTYPE,
    tarfile.GNUTYPE_LONGNAME,
    tarfile.GNUTYPE_LONGLINK,
)


class _Decoder:
    """gzip (also multi-member), zstd (if the zstandard module is there) or a plain tar, by magic."""

    def __init__(self) -> None:
        self._head = b""
        self._kind = ""
        self._z: Any = None

    def feed(self, data: bytes) -> Iterator[bytes]:
        """The decompressed pieces of ``data`` (each at most OUT_CHUNK for gzip), as they come."""
        if not self._kind:
            self._head += data
            if len(self._head) < 4:
                return
            data, self._head = self._head, b""
            self._start(data)
        if self._kind == "tar":
            yield data
            return
        try:
            if self._kind == "zstd":
                yield self._z.decompress(data)
                return
            while data:
                if self._z.eof:  # a gzip stream may be several members one after the other
                    self._z = zlib.decompressobj(31)
                piece = self._z.decompress(data, OUT_CHUNK)
                if piece:
                    yield piece
                data = self._z.unused_data if self._z.eof else self._z.unconsumed_tail
        except _ZLIB_ERROR as exc:
            raise PullError(f"the layer does not decompress: {exc}") from None

    def _start(self, head: bytes) -> None:
        if head[:2] == GZIP_MAGIC:
            self._kind, self._z = "gzip", zlib.decompressobj(31)
        elif head[:4] == ZSTD_MAGIC:
            try:
                import zstandard  # type: ignore[import-not-found]  # optional
            except ImportError:
                raise PullError("zstd layer and no zstandard module installed") from None
            self._kind, self._z = "zstd", zstandard.ZstdDecompressor().decompressobj()
        else:
            self._kind = "tar"

    def finish(self) -> Iterator[bytes]:
        if not self._kind:  # fewer than 4 bytes in all: not a tar either, the reader will say so
            self._kind = "tar"
            if self._head:
                yield self._head
        elif self._kind == "gzip" and not self._z.eof:
            raise PullError("the layer's gzip stream ends early")


class _Entry:
    """The member being read: its header with any PAX/GNU overrides applied."""

    __slots__ = ("gid", "info", "linkname", "mode", "mtime", "name", "size", "type", "uid", "xattrs")

    def __init__(self, info: tarfile.TarInfo, pax: dict[str, str | bytes], long: dict[bytes, str]) -> None:
        self.info = info
        self.type = info.type
        self.name = str(pax.get("path") or long.get(tarfile.GNUTYPE_LONGNAME) or info.name)
        self.linkname = str(pax.get("linkpath") or long.get(tarfile.GNUTYPE_LONGLINK) or info.linkname)
        self.size = int(str(pax["size"])) if "size" in pax else info.size
        self.uid = int(str(pax["uid"])) if "uid" in pax else info.uid
        self.gid = int(str(pax["gid"])) if "gid" in pax else info.gid
        self.mtime = float(str(pax["mtime"])) if "mtime" in pax else float(info.mtime)
        self.mode = info.mode & 0o7777
        self.xattrs = {k.removeprefix(_XATTR): v for k, v in pax.items() if k.startswith(_XATTR)}


class Unpacker:
    """Extract a layer blob fed in chunks into ``dest`` (made here; must not exist yet)."""

    def __init__(self, dest: str) -> None:
        os.makedirs(dest)
        self.root = os.path.realpath(dest)
        self._decoder = _Decoder()
        self._diff = hashlib.sha256()
        self._hdr = bytearray()  # a header block being gathered across buffers
        self._entry: _Entry | None = None
        self._left = 0  # bytes of the current member's data still to come
        self._skip = 0  # padding (or data of a skipped member) still to come
        self._fd = -1  # the regular file being written
        self._meta: bytearray | None = None  # the data of a PAX or GNU long-name member
        self._pax: dict[str, str | bytes] = {}
        self._pax_global: dict[str, str | bytes] = {}
        self._long: dict[bytes, str] = {}
        self._ended = False
        # Directories get their mode and times at the end (their entries would change the times);
        # by name, in the order first seen, the last entry's attributes.
        self._dirs: dict[str, tuple[str, _Entry]] = {}
        self._safe: set[str] = {""}  # parent directories checked to lie inside the root

    # ---- feeding
    def feed(self, blob_chunk: bytes) -> None:
        for data in self._decoder.feed(blob_chunk):
            self._diff.update(data)
            self._tar(data)

    def finish(self) -> str:
        """The diff ID, after the last chunk; the directories get their modes and times."""
        for data in self._decoder.finish():
            self._diff.update(data)
            self._tar(data)
        if not self._ended and (self._entry is not None or self._left or self._hdr):
            raise PullError("the layer's tar ends in the middle of an entry")
        for path, entry in reversed(self._dirs.values()):  # children before their parents
            self._attrs(path, entry, -1)
        return "sha256:" + self._diff.hexdigest()

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def _tar(self, data: bytes) -> None:
        if self._ended:
            return  # what follows the end-of-archive blocks only counts in the diff ID
        view = memoryview(data)
        i, n = 0, len(view)
        while i < n:
            if self._left:
                take = min(self._left, n - i)
                if self._fd >= 0:
                    piece = view[i : i + take]
                    while piece:
                        piece = piece[os.write(self._fd, piece) :]
                elif self._meta is not None:
                    self._meta += view[i : i + take]
                i += take
                self._left -= take
                if not self._left:
                    self._data_done()
            elif self._skip:
                take = min(self._skip, n - i)
                i += take
                self._skip -= take
            else:
                if not self._hdr and n - i >= BLOCK:
                    block = bytes(view[i : i + BLOCK])
                    i += BLOCK
                else:
                    take = min(BLOCK - len(self._hdr), n - i)
                    self._hdr += view[i : i + take]
                    i += take
                    if len(self._hdr) < BLOCK:
                        return
                    block, self._hdr = bytes(self._hdr), bytearray()
                self._header(block)
                if self._ended:
                    return

    # ---- members
    def _header(self, block: bytes) -> None:
        if block == _ZEROS:  # the end of the archive
            self._ended = True
            return
        try:
            info = tarfile.TarInfo.frombuf(block, "utf-8", "surrogateescape")
        except tarfile.HeaderError as exc:
            raise PullError(f"the layer's tar has a bad header: {exc}") from None
        if info.type in _META_TYPES:  # data that describes the next member
            if info.size > 16 * 1024 * 1024:
                raise PullError(f"the layer's tar has a {info.size}-byte extended header")
            self._entry, self._meta = _Entry(info, {}, {}), bytearray()
            self._left, self._skip = info.size, -info.size % BLOCK
            if not self._left:
                self._data_done()
            return
        pax = {**self._pax_global, **self._pax}
        entry = _Entry(info, pax, self._long)
        self._pax, self._long = {}, {}
        if entry.type == tarfile.GNUTYPE_SPARSE or any(k.startswith("GNU.sparse.") for k in pax):
            raise PullError(f"sparse file {entry.name!r} in the layer (not supported)")
        self._entry = entry
        if info.isreg():
            self._left, self._skip = entry.size, -entry.size % BLOCK
        self._extract(entry)
        if not self._left:
            self._data_done()

    def _data_done(self) -> None:
        entry, self._entry = self._entry, None
        assert entry is not None
        if self._meta is not None:
            meta, self._meta = bytes(self._meta), None
            if entry.type == tarfile.XGLTYPE:
                self._pax_global.update(_pax_records(meta))
            elif entry.type in (tarfile.XHDTYPE, tarfile.SOLARIS_XHDTYPE):
                self._pax.update(_pax_records(meta))
            else:
                self._long[entry.type] = meta.split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
        elif self._fd >= 0:
            fd, self._fd = self._fd, -1
            try:
                self._attrs("", entry, fd)
            finally:
                os.close(fd)

    def _extract(self, entry: _Entry) -> None:
        name = os.path.normpath(entry.name.lstrip("/"))
        if name in (".", "") or name == ".." or name.startswith("../"):
            self._skip += self._left  # nothing of it is written
            self._left = 0
            return
        parent_rel, base = os.path.split(name)
        parent = self._parent(parent_rel, entry.name)
        if base == OPAQUE:
            os.setxattr(parent, "trusted.overlay.opaque", b"y")
            return
        if base.startswith(WHITEOUT):
            self._place(os.path.join(parent, base[len(WHITEOUT) :]), name, _mknod, stat.S_IFCHR, 0)
            return
        path = os.path.join(parent, base)
        kind = entry.type
        if entry.info.isreg():
            self._fd = self._place(path, name, _open_new, entry.mode & 0o777, 0)
            return
        if kind == tarfile.DIRTYPE:
            try:
                os.mkdir(path, 0o700)
            except FileExistsError:
                if not os.path.isdir(path) or os.path.islink(path):
                    self._place(path, name, _mkdir, 0o700, 0)
            self._dirs[name] = (path, entry)
            return
        if kind == tarfile.SYMTYPE:
            self._place(path, name, _symlink, 0, 0, entry.linkname)
        elif kind == tarfile.LNKTYPE:
            self._hardlink(path, name, entry)
            return  # shares the attributes of its target
        elif kind in (tarfile.CHRTYPE, tarfile.BLKTYPE, tarfile.FIFOTYPE):
            dev = os.makedev(entry.info.devmajor, entry.info.devminor) if kind != tarfile.FIFOTYPE else 0
            self._place(path, name, _mknod, _NODES[kind] | 0o600, dev)
        else:
            raise PullError(f"entry {entry.name!r} of type {kind!r} in the layer (not supported)")
        self._attrs(path, entry, -1)

    def _parent(self, rel: str, shown: str) -> str:
        """The directory of an entry, made if missing, once it is known to lie inside the root."""
        path = os.path.join(self.root, rel) if rel else self.root
        if rel not in self._safe:
            real = os.path.realpath(path)
            if real != self.root and not real.startswith(self.root + os.sep):
                raise PullError(f"layer entry {shown!r} escapes the rootfs")
            os.makedirs(path, 0o755, exist_ok=True)
            self._safe.add(rel)
        return path

    def _place(self, path: str, rel: str, make: Any, mode: int, dev: int, link: str = "") -> int:
        """Make ``path`` with ``make``, replacing what the layer put there before."""
        try:
            return int(make(path, mode, dev, link))
        except FileExistsError:
            pass
        # An earlier entry of this layer: replaced, and what was checked beneath it forgotten.
        self._safe = {p for p in self._safe if p != rel and not p.startswith(rel + "/")}
        self._dirs = {p: d for p, d in self._dirs.items() if p != rel and not p.startswith(rel + "/")}
        _remove(path)
        return int(make(path, mode, dev, link))

    def _hardlink(self, path: str, rel: str, entry: _Entry) -> None:
        target_rel = os.path.normpath(entry.linkname.lstrip("/"))
        if target_rel in (".", "") or target_rel == ".." or target_rel.startswith("../"):
            raise PullError(f"hard link {entry.name!r} escapes the rootfs")
        target_parent, target_base = os.path.split(target_rel)
        target = os.path.join(self._parent(target_parent, entry.name), target_base)
        try:
            self._place(path, rel, _link, 0, 0, target)
        except FileNotFoundError:
            raise PullError(f"hard link {entry.name!r} to {entry.linkname!r}, not in the layer") from None

    def _attrs(self, path: str, entry: _Entry, fd: int) -> None:
        """Owner, then mode (a chown clears set-ID bits), xattrs and times, by fd when open."""
        target: Any = fd if fd >= 0 else path
        symlink = entry.type == tarfile.SYMTYPE
        if _ROOT:
            if fd >= 0:
                os.fchown(fd, entry.uid, entry.gid)
            else:
                os.lchown(path, entry.uid, entry.gid)
        if not symlink:
            os.chmod(target, entry.mode)
        for key, value in entry.xattrs.items():
            if key.startswith("trusted.overlay."):
                continue  # overlayfs's own markers come from whiteout entries only
            raw = value if isinstance(value, bytes) else value.encode("utf-8", "surrogateescape")
            try:
                if fd >= 0:
                    os.setxattr(fd, key, raw)
                else:
                    os.setxattr(path, key, raw, follow_symlinks=False)
            except OSError:
                pass  # a filesystem without that namespace: the file is still right
        if symlink:
            os.utime(path, (entry.mtime, entry.mtime), follow_symlinks=False)
        else:
            os.utime(target, (entry.mtime, entry.mtime))


def _open_new(path: str, mode: int, dev: int, link: str) -> int:
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)


def _mkdir(path: str, mode: int, dev: int, link: str) -> int:
    os.mkdir(path, mode)
    return -1


def _mknod(path: str, mode: int, dev: int, link: str) -> int:
    os.mknod(path, mode, dev)
    return -1


def _symlink(path: str, mode: int, dev: int, link: str) -> int:
    os.symlink(link, path)
    return -1


def _link(path: str, mode: int, dev: int, link: str) -> int:
    os.link(link, path, follow_symlinks=False)  # the entry itself, never where a symlink points
    return -1


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    else:
        os.unlink(path)


def _pax_records(data: bytes) -> dict[str, str | bytes]:
    """``LEN key=value\\n`` records; xattr values kept as bytes, the rest as text."""
    out: dict[str, str | bytes] = {}
    pos = 0
    while pos < len(data) and data[pos] != 0:
        space = data.find(b" ", pos)
        try:
            length = int(data[pos:space])
        except ValueError:
            raise PullError("the layer's tar has a bad PAX header") from None
        if space < 0 or length <= space - pos + 1 or pos + length > len(data):
            raise PullError("the layer's tar has a bad PAX header")
        key, eq, value = data[space + 1 : pos + length - 1].partition(b"=")
        if not eq:
            raise PullError("the layer's tar has a bad PAX header")
        name = key.decode("utf-8", "surrogateescape")
        out[name] = value if name.startswith(_XATTR) else value.decode("utf-8", "surrogateescape")
        pos += length
    return out


def unpack_fileobj(fh: IO[bytes], dest: str) -> str:
    """Unpack a layer blob read from ``fh`` into ``dest`` in overlayfs form; return its diff ID."""
    unpacker = Unpacker(dest)
    try:
        while chunk := fh.read(1024 * 1024):
            unpacker.feed(chunk)
        return unpacker.finish()
    finally:
        unpacker.close()


def unpack_layer(blob: str, dest: str) -> str:
    """Unpack a layer blob file into ``dest`` in overlayfs form; return its diff ID."""
    with open(blob, "rb") as fh:
        return unpack_fileobj(fh, dest)
