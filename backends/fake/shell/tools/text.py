"""Tools over text streams: cat, head, tail, wc, grep, tr, tee, yes, seq, sort, basename, dirname."""

from __future__ import annotations

import asyncio
import codecs
import itertools
import re
import string
from typing import TypeVar

from backends.fake.shell.arithmetic import arith_number
from backends.fake.shell.control import ToolError, reason
from backends.fake.shell.evaluation import Builtin, Shell
from backends.fake.shell.options import getopt, integer
from backends.fake.shell.patterns import posix_regex
from backends.fake.shell.streams import Reader, Writer, dec, enc
from backends.fake.shell.tools.printing import unescape


async def _t_cat(sh: Shell, argv: list[str]) -> int:
    """cat [FILE|-]...: copies as it reads, so a `cat` container echoes its stdin live."""
    _, names = getopt(argv, "u")
    status = 0
    for name in names or ["-"]:
        try:
            reader = sh.open_input(name)
        except OSError as exc:
            await sh.err(f"cat: can't open '{name}': {reason(exc)}")
            status = 1
            continue
        while chunk := await sh.read(reader):
            await sh.out(chunk)
    return status


def _legacy_count(argv: list[str]) -> list[str]:
    """head -5 / tail -5 as -n 5."""
    if len(argv) > 1 and re.fullmatch(r"-\d+", argv[1]):
        return [argv[0], "-n", argv[1][1:], *argv[2:]]
    return argv


def _count(opts: dict[str, str]) -> tuple[int, bool]:
    """The count of head/tail -n/-c (the last one given), and whether it was +N (tail from N)."""
    text = opts.get("c", opts.get("n", "10")).split("\n")[-1]
    value = arith_number(text.lstrip("+-"))
    if value is None or value < 0:
        raise ToolError(f"invalid number '{text}'")
    return value, text.startswith("+")


async def _head_lines(sh: Shell, reader: Reader, count: int) -> bytes:
    """The first count lines; what was read past them goes back to the reader."""
    buf = bytearray()
    lines = 0
    while lines < count:
        chunk = await sh.read(reader)
        if not chunk:
            return bytes(buf)
        buf += chunk
        lines += chunk.count(b"\n")
    end = -1
    for _ in range(count):
        end = buf.index(b"\n", end + 1)
    reader.unread(bytes(buf[end + 1 :]))
    return bytes(buf[: end + 1])


async def _head_bytes(sh: Shell, reader: Reader, count: int) -> bytes:
    buf = bytearray()
    while len(buf) < count and (chunk := await sh.read(reader)):
        buf += chunk
    reader.unread(bytes(buf[count:]))
    return bytes(buf[:count])


async def _t_head(sh: Shell, argv: list[str]) -> int:
    """head [-n N|-N|-c N] [FILE...]: stops reading at N, so `yes | head` ends."""
    opts, names = getopt(_legacy_count(argv), "qv", "nc")
    count, _ = _count(opts)
    take = _head_bytes if "c" in opts else _head_lines
    status = 0
    for k, name in enumerate(names or ["-"]):
        if len(names) > 1:
            await sh.out(f"{chr(10) if k else ''}==> {name} <==\n")
        try:
            reader = sh.open_input(name)
        except OSError as exc:
            await sh.err(f"head: {name}: {reason(exc)}")
            status = 1
            continue
        await sh.out(await take(sh, reader, count))
    return status


_Items = TypeVar("_Items", bytes, list[bytes])


def _tail_of(items: _Items, count: int, from_start: bool) -> _Items:
    """The last count items, or those from the count-th on (tail -n +N)."""
    if from_start:
        return items[max(count - 1, 0) :]
    return items[len(items) - count :] if count else items[:0]


async def _t_tail(sh: Shell, argv: list[str]) -> int:
    """tail [-n [+]N|-N|-c N] [-f] [FILE...]; -f prints and then waits until stopped (no following)."""
    opts, names = getopt(_legacy_count(argv), "fFqv", "nc")
    count, from_start = _count(opts)
    status = 0
    for name in names or ["-"]:
        try:
            data = await sh.read_all(sh.open_input(name))
        except OSError as exc:
            await sh.err(f"tail: {name}: {reason(exc)}")
            status = 1
            continue
        if "c" in opts:
            await sh.out(_tail_of(data, count, from_start))
        else:
            await sh.out(b"".join(_tail_of(data.splitlines(True), count, from_start)))
    if "f" in opts or "F" in opts:
        await sh.sleep_forever()
    return status


def _wc_count(data: bytes, key: str) -> int:
    if key == "l":
        return data.count(b"\n")
    if key == "w":
        return len(data.split())
    return len(dec(data)) if key == "m" else len(data)


async def _t_wc(sh: Shell, argv: list[str]) -> int:
    opts, names = getopt(argv, "lwcm")
    keys = [k for k in "lwmc" if k in opts] or ["l", "w", "c"]
    rows: list[tuple[list[int], str]] = []
    status = 0
    for name in names or ["-"]:
        try:
            data = await sh.read_all(sh.open_input(name))
        except OSError as exc:
            await sh.err(f"wc: {name}: {reason(exc)}")
            status = 1
            continue
        rows.append(([_wc_count(data, k) for k in keys], name if names else ""))
    if len(rows) > 1:
        rows.append(([sum(col) for col in zip(*(r[0] for r in rows), strict=True)], "total"))
    width = 7 if len(keys) > 1 and not names else max((len(str(c)) for r in rows for c in r[0]), default=1)
    lines = (
        " ".join(str(c).rjust(width) for c in counts) + (f" {label}" if label else "")
        for counts, label in rows
    )
    await sh.out("".join(line + "\n" for line in lines))
    return status


def _grep_regex(patterns: list[str], opts: dict[str, str]) -> re.Pattern[str]:
    bodies = []
    for pattern in patterns:
        body = re.escape(pattern) if "F" in opts else posix_regex(pattern, extended="E" in opts)
        if "x" in opts:
            body = f"^(?:{body})$"
        elif "w" in opts:
            body = rf"(?<!\w)(?:{body})(?!\w)"
        bodies.append(f"(?:{body})")
    return re.compile("|".join(bodies), re.I if "i" in opts else 0)


async def _grep_stream(
    sh: Shell, reader: Reader, regex: re.Pattern[str], opts: dict[str, str], label: str
) -> int:
    """Matches line by line as input arrives; returns the count of selected lines."""
    limit = integer(opts["m"]) if "m" in opts else -1
    count = number = 0
    while count != limit and (line := await reader.line(sh.block)):
        number += 1
        text = dec(line).removesuffix("\n")
        if (regex.search(text) is None) != ("v" in opts):
            continue
        count += 1
        if "q" in opts or "l" in opts:
            break
        if "c" in opts:
            continue
        head = label + (f"{number}:" if "n" in opts else "")
        if "o" in opts and "v" not in opts:
            await sh.out("".join(f"{head}{m.group()}\n" for m in regex.finditer(text) if m.group()))
        else:
            await sh.out(f"{head}{text}\n")
    return count


async def _t_grep(sh: Shell, argv: list[str]) -> int:
    """grep [-qvicnlowxsEFHh] [-e PATTERN|PATTERN] [-m N] [FILE...]: 0 matched, 1 none, 2 error."""
    opts, operands = getopt(argv, "qvicnlowxsEFHh", "em")
    if "e" in opts:
        patterns = opts["e"].split("\n")
    elif operands:
        patterns, operands = operands[0].split("\n"), operands[1:]
    else:
        raise ToolError("usage: grep [OPTION]... PATTERN [FILE]...", 2)
    try:
        regex = _grep_regex(patterns, opts)
    except re.error as exc:
        raise ToolError(f"bad regex '{patterns[0]}': {exc}", 2) from None
    names = operands or ["-"]
    labelled = ("H" in opts or len(names) > 1) and "h" not in opts
    found = failed = False
    for name in names:
        try:
            reader = sh.open_input(name)
        except OSError as exc:
            failed = True
            if "s" not in opts:
                await sh.err(f"grep: {name}: {reason(exc)}")
            continue
        count = await _grep_stream(sh, reader, regex, opts, f"{name}:" if labelled else "")
        found = found or count > 0
        if found and "q" in opts:
            return 0
        if "c" in opts:
            await sh.out(f"{name + ':' if labelled else ''}{count}\n")
        elif "l" in opts and count:
            await sh.out(name + "\n")
    return 2 if failed else 0 if found else 1


_TR_CLASSES = {
    "lower": string.ascii_lowercase,
    "upper": string.ascii_uppercase,
    "digit": string.digits,
    "alpha": string.ascii_letters,
    "alnum": string.ascii_letters + string.digits,
    "space": " \t\n\r\f\v",
    "blank": " \t",
    "punct": string.punctuation,
    "xdigit": string.hexdigits,
}


def _tr_set(spec: str) -> str:
    """A tr set (escapes, a-z ranges, [:class:] names) as the characters it stands for."""
    text, _ = unescape(spec, printf=True)
    chars: list[str] = []
    i = 0
    while i < len(text):
        end = text.find(":]", i) if text.startswith("[:", i) else -1
        if end > 0 and text[i + 2 : end] in _TR_CLASSES:
            chars.append(_TR_CLASSES[text[i + 2 : end]])
            i = end + 2
        elif i + 2 < len(text) and text[i + 1] == "-":
            chars.extend(chr(c) for c in range(ord(text[i]), ord(text[i + 2]) + 1))
            i += 3
        else:
            chars.append(text[i])
            i += 1
    return "".join(chars)


def _squeeze(text: str, chars: set[str], last: str) -> tuple[str, str]:
    """tr -s: runs of the same character of chars become one; last carries over between chunks."""
    out = []
    for c in text:
        if c != last or c not in chars:
            out.append(c)
        last = c
    return "".join(out), last


async def _t_tr(sh: Shell, argv: list[str]) -> int:
    """tr [-d] [-s] SET1 [SET2]: streams, so it works inside an endless pipeline."""
    opts, sets = getopt(argv, "ds")
    if not sets or len(sets) > 2 or (len(sets) == 1 and not opts):
        raise ToolError("missing operand")
    source = _tr_set(sets[0])
    target = _tr_set(sets[1]) if len(sets) > 1 else ""
    table: dict[int, int | None]
    if "d" in opts:
        table = dict.fromkeys(map(ord, source))
    elif target:
        table = {ord(c): ord(target[min(i, len(target) - 1)]) for i, c in enumerate(source)}
    else:
        table = {}
    squeeze = set(target or source) if "s" in opts else set()
    decoder = codecs.getincrementaldecoder("utf-8")("surrogateescape")
    reader = sh.input()
    last = ""
    while True:
        chunk = await sh.read(reader)
        text = decoder.decode(chunk, final=not chunk).translate(table)
        if squeeze:
            text, last = _squeeze(text, squeeze, last)
        await sh.out(text)
        if not chunk:
            return 0


async def _t_tee(sh: Shell, argv: list[str]) -> int:
    opts, names = getopt(argv, "ai")
    writers: list[Writer] = []
    status = 0
    for name in names:
        try:
            writers.append(sh.open_output(name, append="a" in opts))
        except OSError as exc:
            await sh.err(f"tee: {name}: {reason(exc)}")
            status = 1
    reader = sh.input()
    while chunk := await sh.read(reader):
        await sh.out(chunk)
        for writer in writers:
            await writer.write(chunk)
    return status


async def _t_yes(sh: Shell, argv: list[str]) -> int:
    """yes [STRING]: forever, until its reader goes (SIGPIPE) or the run is cancelled."""
    line = (" ".join(argv[1:]) or "y") + "\n"
    chunk = enc(line * max(1, 4096 // len(line)))
    while True:
        await sh.out(chunk)
        await asyncio.sleep(0)  # a reader that never makes us wait must not starve the loop


def _seq_value(text: str) -> int | float:
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        raise ToolError(f"invalid floating point argument: '{text}'") from None


async def _t_seq(sh: Shell, argv: list[str]) -> int:
    """seq [-s SEP] [-w] [FIRST [STEP]] LAST: written as produced, so `seq 1000000 | head` ends."""
    separator, pad, operands = "\n", False, []
    args = iter(argv[1:])
    for arg in args:
        if arg == "-w":
            pad = True
        elif arg.startswith("-s") and not re.fullmatch(r"-[\d.]+", arg):
            separator = arg[2:] or next(args, "\n")
        else:
            operands.append(arg)
    if not 1 <= len(operands) <= 3:
        raise ToolError("missing operand")
    values = [_seq_value(o) for o in operands]
    first: int | float = values[0] if len(values) > 1 else 1
    step: int | float = values[1] if len(values) == 3 else 1
    last = values[-1]
    if step == 0:
        raise ToolError("invalid Zero increment value: '0'")
    decimals = max((len(o.partition(".")[2]) for o in operands), default=0)
    width = max(len(f"{v:.{decimals}f}") for v in (first, last)) if pad else 0
    batch: list[str] = []
    for k in itertools.count():
        value = first + k * step
        if (value > last) if step > 0 else (value < last):
            break
        batch.append((separator if k else "") + f"{value:.{decimals}f}".zfill(width))
        if len(batch) == 512:
            await sh.out("".join(batch))
            batch = []
    await sh.out("".join(batch) + ("\n" if k else ""))
    return 0


_LEADING_NUMBER = re.compile(r"\s*[-+]?(?:\d+\.?\d*|\.\d+)")


def _numeric_key(line: str) -> tuple[float, str]:
    """sort -n: by the number a line starts with (0 without one), then by the whole line."""
    m = _LEADING_NUMBER.match(line)
    return (float(m.group()) if m else 0.0), line


async def _t_sort(sh: Shell, argv: list[str]) -> int:
    """sort [-rnu] [FILE...]: whole lines (env | sort)."""
    opts, names = getopt(argv, "rnu")
    chunks = []
    for name in names or ["-"]:
        try:
            chunks.append(await sh.read_all(sh.open_input(name)))
        except OSError as exc:
            raise ToolError(f"{name}: {reason(exc)}", 2) from None
    numeric = "n" in opts
    lines = sorted(
        dec(b"".join(chunks)).splitlines(), key=_numeric_key if numeric else None, reverse="r" in opts
    )
    if "u" in opts:  # -u keeps the first of lines that sort equal: the same number for -n
        same = [
            (numeric and _numeric_key(a)[0] == _numeric_key(b)[0]) or a == b
            for a, b in itertools.pairwise(lines)
        ]
        lines = lines[:1] + [line for line, repeated in zip(lines[1:], same, strict=True) if not repeated]
    await sh.out("".join(line + "\n" for line in lines))
    return 0


async def _t_basename(sh: Shell, argv: list[str]) -> int:
    args = argv[1:] if argv[1:2] != ["--"] else argv[2:]
    if not args:
        raise ToolError("missing operand")
    stripped = args[0].rstrip("/")
    base = stripped.rsplit("/", 1)[-1] if stripped else "/" if args[0] else ""
    if len(args) > 1 and base != args[1] and base.endswith(args[1]):
        base = base[: -len(args[1])]
    await sh.out(base + "\n")
    return 0


async def _t_dirname(sh: Shell, argv: list[str]) -> int:
    args = argv[1:] if argv[1:2] != ["--"] else argv[2:]
    if not args:
        raise ToolError("missing operand")
    stripped = args[0].rstrip("/")
    if not stripped:
        result = "/" if args[0] else "."
    elif "/" not in stripped:
        result = "."
    else:
        result = stripped.rsplit("/", 1)[0].rstrip("/") or "/"
    await sh.out(result + "\n")
    return 0


COMMANDS: dict[str, Builtin] = {
    "cat": _t_cat,
    "head": _t_head,
    "tail": _t_tail,
    "wc": _t_wc,
    "grep": _t_grep,
    "tr": _t_tr,
    "tee": _t_tee,
    "yes": _t_yes,
    "seq": _t_seq,
    "sort": _t_sort,
    "basename": _t_basename,
    "dirname": _t_dirname,
}
