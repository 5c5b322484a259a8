"""The CRI log format: records, partial lines, reopen after rotation."""

import os
import re

from shim.logs import MAX_RECORD, CriLogWriter, rfc3339_nano

RECORD = re.compile(rb"^(\S+) (stdout|stderr) ([PF]) (.*)$")


def read(path: str) -> list[tuple[bytes, bytes, bytes]]:
    with open(path, "rb") as f:
        out = []
        for line in f.read().splitlines():
            m = RECORD.match(line)
            assert m, line
            out.append((m.group(2), m.group(3), m.group(4)))
        return out


def test_timestamp_format() -> None:
    assert rfc3339_nano(1_700_000_000_123_456_789) == b"2023-11-14T22:13:20.123456789Z"


def test_lines_and_partials(tmp_path: object) -> None:
    path = os.path.join(str(tmp_path), "a", "c.log")
    w = CriLogWriter(path)
    w.write("stdout", b"hel")
    w.write("stdout", b"lo\nwor")
    w.write("stderr", b"err\n")
    w.write("stdout", b"ld\n")
    w.write("stdout", b"x" * (MAX_RECORD * 2 + 5) + b"\n")
    w.write("stdout", b"tail without newline")
    w.close()
    recs = read(path)
    assert recs[:3] == [(b"stdout", b"F", b"hello"), (b"stderr", b"F", b"err"), (b"stdout", b"F", b"world")]
    assert [r[1] for r in recs[3:6]] == [b"P", b"P", b"F"]
    assert b"".join(r[2] for r in recs[3:6]) == b"x" * (MAX_RECORD * 2 + 5)
    assert recs[6] == (b"stdout", b"P", b"tail without newline")


def test_reopen_after_rotation(tmp_path: object) -> None:
    path = os.path.join(str(tmp_path), "c.log")
    w = CriLogWriter(path)
    w.write("stdout", b"one\n")
    os.rename(path, path + ".1")
    w.write("stdout", b"two\n")  # still goes to the renamed file
    w.reopen()
    w.write("stdout", b"three\n")
    w.close()
    assert [r[2] for r in read(path + ".1")] == [b"one", b"two"]
    assert [r[2] for r in read(path)] == [b"three"]


def test_records_carry_the_time_given(tmp_path: object) -> None:
    path = os.path.join(str(tmp_path), "c.log")
    w = CriLogWriter(path, clock_ns=lambda: 2_000_000_000_000_000_000)
    w.write("stdout", b"from the runtime\n", at=1_700_000_000_123_456_789)
    w.write("stderr", b"no time given\n")
    w.close()
    with open(path, "rb") as f:
        stamps = [line.split(b" ", 1)[0] for line in f.read().splitlines()]
    assert stamps == [rfc3339_nano(1_700_000_000_123_456_789), rfc3339_nano(2_000_000_000_000_000_000)]
