"""runv's layer unpacker (backends/runv/images/unpack.py): tar members in overlayfs form, the
diff ID, what a hostile or broken layer may not do."""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import stat
import tarfile
from pathlib import Path

import pytest

from backends.oci.registry import PullError
from backends.runv.images.unpack import Unpacker, unpack_layer

Member = tuple[tarfile.TarInfo, bytes | None]


def member(name: str, data: bytes | None = None, *, kind: bytes = tarfile.REGTYPE, **attrs: object) -> Member:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.mode = 0o644 if kind != tarfile.DIRTYPE else 0o755
    for key, value in attrs.items():
        setattr(info, key, value)
    if data is not None:
        info.size = len(data)
    return info, data


def tar_of(members: list[Member], fmt: int = tarfile.PAX_FORMAT) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tar:
        for info, data in members:
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return buf.getvalue()


def unpack(tmp_path: Path, raw: bytes, *, piece: int = 0) -> tuple[Path, str]:
    """Unpack ``raw`` (fed ``piece`` bytes at a time, or at once) into tmp_path/fs."""
    dest = tmp_path / "fs"
    unpacker = Unpacker(str(dest))
    try:
        step = piece or len(raw) or 1
        for i in range(0, len(raw), step):
            unpacker.feed(raw[i : i + step])
        return dest, unpacker.finish()
    finally:
        unpacker.close()


def test_unpack_whiteouts_and_safety(tmp_path: Path) -> None:
    raw = tar_of(
        [
            member("etc", kind=tarfile.DIRTYPE),
            member("etc/hostname", b"img\n"),
            member("bin/", kind=tarfile.DIRTYPE),
            member("bin/su", b"#!", mode=0o4755),  # setuid bits survive
            member("etc/.wh.passwd", b""),  # delete a lower file
            member("var/.wh..wh..opq", b""),  # hide the lower directory's content
            member("../escape", b"x"),
        ]
    )
    blob = tmp_path / "layer.tar.gz"
    blob.write_bytes(gzip.compress(raw))
    dest = tmp_path / "fs"
    diff_id = unpack_layer(str(blob), str(dest))
    assert diff_id == "sha256:" + hashlib.sha256(raw).hexdigest()  # diff IDs hash the uncompressed tar
    assert (dest / "etc/hostname").read_bytes() == b"img\n"
    assert stat.S_IMODE(os.stat(dest / "bin/su").st_mode) == 0o4755
    wh = os.lstat(dest / "etc/passwd")
    assert stat.S_ISCHR(wh.st_mode) and wh.st_rdev == 0  # overlayfs whiteout
    assert os.getxattr(dest / "var", "trusted.overlay.opaque") == b"y"
    assert not (tmp_path / "escape").exists()


def test_unpack_rejects_symlink_escape(tmp_path: Path) -> None:
    (tmp_path / "outside").mkdir()
    raw = tar_of(
        [member("evil", kind=tarfile.SYMTYPE, linkname=str(tmp_path / "outside")), member("evil/pwned", b"x")]
    )
    with pytest.raises(PullError, match="escapes"):
        unpack(tmp_path, raw)
    assert not (tmp_path / "outside/pwned").exists()


@pytest.mark.parametrize("piece", [0, 1, 511, 513, 4096], ids=["whole", "1", "511", "513", "4096"])
def test_unpack_any_chunking(tmp_path: Path, piece: int) -> None:
    """The same files and diff ID however the stream is cut (headers and data across chunks)."""
    big = os.urandom(70_000)
    raw = tar_of(
        [
            member("d", kind=tarfile.DIRTYPE),
            member("d/" + "long-name-" * 20, b"a long name (a PAX header)\n"),
            member("d/big", big, mode=0o600, uid=1234, gid=5678, mtime=1_600_000_000),
            member("d/empty", b""),
            member("d/link", kind=tarfile.SYMTYPE, linkname="big"),
            member("d/hard", kind=tarfile.LNKTYPE, linkname="d/big"),
            member("d/fifo", kind=tarfile.FIFOTYPE),
        ]
    )
    dest, diff_id = unpack(tmp_path, gzip.compress(raw), piece=piece)
    assert diff_id == "sha256:" + hashlib.sha256(raw).hexdigest()
    assert (dest / "d" / ("long-name-" * 20)).read_bytes() == b"a long name (a PAX header)\n"
    st = os.stat(dest / "d/big")
    assert (dest / "d/big").read_bytes() == big
    assert (stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid, st.st_mtime) == (0o600, 1234, 5678, 1_600_000_000)
    assert (dest / "d/empty").read_bytes() == b""
    assert os.readlink(dest / "d/link") == "big"
    assert os.stat(dest / "d/hard").st_ino == st.st_ino and st.st_nlink == 2
    assert stat.S_ISFIFO(os.lstat(dest / "d/fifo").st_mode)


def test_unpack_gnu_long_names_and_xattrs(tmp_path: Path) -> None:
    name = "x/" + "n" * 150
    target = "t" * 120
    info, _ = member("x/attrs", b"y")
    info.pax_headers = {"SCHILY.xattr.user.note": "kept", "SCHILY.xattr.trusted.overlay.redirect": "/etc"}
    gnu = tar_of(
        [member(name, b"gnu"), member("x/l", kind=tarfile.SYMTYPE, linkname=target)], tarfile.GNU_FORMAT
    )
    dest, _ = unpack(tmp_path, gnu)
    assert (dest / name).read_bytes() == b"gnu" and os.readlink(dest / "x/l") == target
    probe = tmp_path / "probe"
    probe.write_bytes(b"")
    try:
        os.setxattr(probe, "user.probe", b"1")
    except OSError:
        pytest.skip("no user xattrs on this filesystem")
    dest2, _ = unpack(tmp_path / "pax", tar_of([(info, b"y")]))
    assert os.getxattr(dest2 / "x/attrs", "user.note") == b"kept"
    assert "trusted.overlay.redirect" not in os.listxattr(
        dest2 / "x/attrs"
    )  # overlayfs markers: never from a tar


def test_unpack_directory_modes_last_and_replaced_entries(tmp_path: Path) -> None:
    """A read-only directory still gets its files; an entry replaces an earlier one of the same
    name; a directory replaced by a symlink to the outside does not get its mode applied there."""
    outside = tmp_path / "outside"
    outside.mkdir(mode=0o700)
    raw = tar_of(
        [
            member("ro", kind=tarfile.DIRTYPE, mode=0o555),
            member("ro/file", b"1"),
            member("f", b"old"),
            member("f", b"new"),
            member("gone", kind=tarfile.DIRTYPE, mode=0o777),
            member("gone", kind=tarfile.SYMTYPE, linkname=str(outside)),
        ]
    )
    dest, _ = unpack(tmp_path, raw)
    assert stat.S_IMODE(os.stat(dest / "ro").st_mode) == 0o555 and (dest / "ro/file").read_bytes() == b"1"
    assert (dest / "f").read_bytes() == b"new"
    assert os.path.islink(dest / "gone")
    assert stat.S_IMODE(os.stat(outside).st_mode) == 0o700


@pytest.mark.parametrize(
    "linkname",
    ["../../etc/passwd", "/../etc/passwd", "missing"],
    ids=["dotdot", "absolute-dotdot", "missing"],
)
def test_unpack_refuses_bad_hard_links(tmp_path: Path, linkname: str) -> None:
    raw = tar_of([member("h", kind=tarfile.LNKTYPE, linkname=linkname)])
    with pytest.raises(PullError, match="hard link"):
        unpack(tmp_path, raw)


def test_hard_link_to_a_symlink_links_the_symlink(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_bytes(b"host file")
    raw = tar_of(
        [
            member("s", kind=tarfile.SYMTYPE, linkname=str(secret)),
            member("h", kind=tarfile.LNKTYPE, linkname="s"),
        ]
    )
    dest, _ = unpack(tmp_path, raw)
    assert os.path.islink(dest / "h")  # not a second name of the host's file
    assert os.stat(secret).st_nlink == 1


@pytest.mark.parametrize(
    ("make", "error"),
    [
        (lambda raw: gzip.compress(raw)[:-20], "ends early|decompress"),
        (lambda raw: raw[:700], "middle of an entry"),
        (lambda raw: b"\x1f\x8b" + b"garbage" * 10, "does not decompress"),
        (lambda raw: b"x" * 512, "bad header"),
    ],
    ids=["truncated-gzip", "truncated-tar", "not-gzip", "not-tar"],
)
def test_unpack_broken_layers(tmp_path: Path, make: object, error: str) -> None:
    raw = tar_of([member("a", b"z" * 1000)])
    with pytest.raises(PullError, match=error):
        unpack(tmp_path, make(raw))  # type: ignore[operator]


def test_multi_member_gzip(tmp_path: Path) -> None:
    raw = tar_of([member("a", b"first" * 300), member("b", b"second" * 300)])
    cut = 1024
    dest, diff_id = unpack(tmp_path, gzip.compress(raw[:cut]) + gzip.compress(raw[cut:]), piece=100)
    assert diff_id == "sha256:" + hashlib.sha256(raw).hexdigest()
    assert (dest / "b").read_bytes() == b"second" * 300


def test_sparse_members_are_refused(tmp_path: Path) -> None:
    info, data = member("s", b"abc")
    info.pax_headers = {"GNU.sparse.major": "1", "GNU.sparse.minor": "0"}
    with pytest.raises(PullError, match="sparse"):
        unpack(tmp_path, tar_of([(info, data)]))
