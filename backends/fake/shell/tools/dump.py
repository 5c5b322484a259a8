"""hexdump -C: a file's bytes in hex and ASCII, as the e2e specs read a binary ConfigMap key."""

from __future__ import annotations

from backends.fake.shell.control import ToolError, reason
from backends.fake.shell.evaluation import Builtin, Shell
from backends.fake.shell.options import getopt


def canonical(data: bytes, squeeze: bool = True) -> str:
    """``hexdump -C``'s lines: offset, 16 bytes in hex (two groups of 8), the bytes as ASCII; a run
    of lines equal to the one before is one ``*`` (unless not ``squeeze``: -v); the length last
    (nothing for no input)."""
    lines, previous, starred = [], b"", False
    for offset in range(0, len(data), 16):
        row = data[offset : offset + 16]
        if squeeze and row == previous and len(row) == 16:
            if not starred:
                lines.append("*")
                starred = True
            continue
        previous, starred = row, False
        cells = [f"{b:02x} " if i < len(row) else "   " for i, b in enumerate(row.ljust(16, b"\0"))]
        text = "".join(chr(b) if 0x20 <= b < 0x7F else "." for b in row)
        lines.append(f"{offset:08x}  {''.join(cells[:8])} {''.join(cells[8:])} |{text}|")
    if data:
        lines.append(f"{len(data):08x}")
    return "".join(line + "\n" for line in lines)


async def _t_hexdump(sh: Shell, argv: list[str]) -> int:
    """hexdump -C [-v] [FILE...]: the files one after another, or stdin."""
    opts, names = getopt(argv, "Cv", "nse")
    if "C" not in opts:
        raise ToolError("only -C (canonical hex+ASCII) is supported by the fake runtime's hexdump")
    data, status = b"", 0
    for name in names or ["-"]:
        try:
            data += await sh.read_all(sh.open_input(name))
        except OSError as exc:
            await sh.err(f"hexdump: {name}: {reason(exc)}")
            status = 1
    text = canonical(data, squeeze="v" not in opts)
    await sh.out(text)
    return status


COMMANDS: dict[str, Builtin] = {"hexdump": _t_hexdump}
