"""Options: how commands read theirs (getopt, numbers), and the shell's own (set, sh)."""

from __future__ import annotations

from backends.fake.shell.arithmetic import arith_number
from backends.fake.shell.control import ToolError


def getopt(argv: list[str], flags: str, valued: str = "") -> tuple[dict[str, str], list[str]]:
    """Short options as POSIX tools take them (-abc, -n5, -n 5) up to "--" or the first operand;
    a repeated valued option keeps every value, newline-separated (grep -e a -e b)."""
    opts: dict[str, str] = {}
    i = 1
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            i += 1
            break
        if len(arg) < 2 or arg[0] != "-":
            break
        i += 1
        for j, c in enumerate(arg[1:], 1):
            if c in valued:
                value = arg[j + 1 :]
                if not value:
                    if i >= len(argv):
                        raise ToolError(f"option requires an argument -- '{c}'")
                    value = argv[i]
                    i += 1
                opts[c] = opts[c] + "\n" + value if c in opts else value
                break
            if c not in flags:
                raise ToolError(f"invalid option -- '{c}'")
            opts[c] = ""
    return opts, argv[i:]


def integer(text: str, what: str = "number") -> int:
    value = arith_number(text)
    if value is None:
        raise ToolError(f"invalid {what} '{text}'")
    return value


LONG_OPTIONS = {
    "errexit": "e",
    "xtrace": "x",
    "nounset": "u",
    "noglob": "f",
    "verbose": "v",
    "noexec": "n",
    "allexport": "a",
    "pipefail": "pipefail",
}
SHORT_OPTIONS = "efuvxnaC"


def option(name: str) -> str:
    flag = LONG_OPTIONS.get(name)
    if flag is None:
        raise ToolError(f"illegal option -o {name}", 2)
    return flag
