"""What agnhost's subcommands share: cobra's flags, and Go's way of printing quotes and errors."""

from __future__ import annotations

import os

from backends.fake.shell.evaluation import Shell

FlagValue = str | int | bool


class Flags:
    """A subcommand's flags after parsing: its defaults, overridden by the command line."""

    def __init__(self, values: dict[str, FlagValue]) -> None:
        self.values = values

    def text(self, name: str) -> str:
        return str(self.values[name])

    def integer(self, name: str) -> int:
        value = self.values[name]
        assert isinstance(value, int)
        return int(value)

    def boolean(self, name: str) -> bool:
        return bool(self.values[name])


_TRUE = ("1", "t", "T", "true", "TRUE", "True")
_FALSE = ("0", "f", "F", "false", "FALSE", "False")


def parse_flags(args: list[str], spec: dict[str, FlagValue], operands: bool = False) -> Flags:
    """pflag's long flags (``--name=value``, ``--name value``; a boolean bare or ``=false``) with
    the defaults of ``spec``, whose values' types are the flags' types; ValueError in cobra's words.
    klog's ``--v``/``-v`` (agnhost takes logging flags everywhere) are taken and ignored. Operands are
    refused unless ``operands`` (cobra's MaximumNArgs(0) of most subcommands)."""
    values: dict[str, FlagValue] = dict(spec)
    i = 0
    while i < len(args):
        arg = args[i]
        i += 1
        if arg == "--":
            if i < len(args) and not operands:
                raise ValueError(f'unknown command "{args[i]}" for this subcommand')
            break
        if not arg.startswith("-") or arg == "-":
            if operands:
                continue
            raise ValueError(f'unknown command "{arg}" for this subcommand')
        name, eq, value = arg.lstrip("-").partition("=")
        if name in ("v", "vmodule", "logtostderr", "alsologtostderr", "stderrthreshold"):
            if not eq and name in ("v", "vmodule", "stderrthreshold") and i < len(args):
                i += 1
            continue
        if name not in spec:
            shown = f"--{name}" if arg.startswith("--") else f"-{name}"
            raise ValueError(
                f"unknown flag: {shown}"
                if len(name) > 1 or arg.startswith("--")
                else f"unknown shorthand flag: '{name}' in {arg}"
            )
        default = spec[name]
        if isinstance(default, bool):
            if not eq:
                values[name] = True
            elif value in _TRUE or value in _FALSE:
                values[name] = value in _TRUE
            else:
                raise ValueError(
                    f'invalid argument "{value}" for "--{name}" flag: strconv.ParseBool: '
                    f'parsing "{value}": invalid syntax'
                )
            continue
        if not eq:
            if i >= len(args):
                raise ValueError(f"flag needs an argument: --{name}")
            value = args[i]
            i += 1
        if isinstance(default, int):
            try:
                values[name] = int(value, 0)
            except ValueError:
                raise ValueError(
                    f'invalid argument "{value}" for "--{name}" flag: strconv.ParseInt: '
                    f'parsing "{value}": invalid syntax'
                ) from None
        else:
            values[name] = value
    return Flags(values)


def go_quote(text: str) -> str:
    """Go's %q of a string (strconv.Quote) for the printable text paths are."""
    out = []
    for c in text:
        if c in '"\\':
            out.append("\\" + c)
        elif c == "\n":
            out.append("\\n")
        elif c == "\t":
            out.append("\\t")
        elif not c.isprintable():
            out.append(f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}")
        else:
            out.append(c)
    return '"' + "".join(out) + '"'


def go_error(exc: OSError) -> str:
    """An errno as Go's syscall.Errno prints it: strerror in lower case (``no such file or directory``)."""
    if exc.errno is None:
        return str(exc.strerror or exc)
    text = os.strerror(exc.errno)
    return text[:1].lower() + text[1:]


async def wait_for_signal(sh: Shell, handled: frozenset[str]) -> str:
    """Waits for one of the signals ``handled`` (the program handles them, as Go's signal.Notify
    does: so also as PID 1) and gives its name; another signal has its usual effect on the shell."""
    if sh.background:
        await sh.sleep_forever()  # a background job is not signalled
    session = sh.session
    while True:
        await session.term.wait()
        name, inside = session.take()
        if name in handled:
            return name
        await session.owner.signal(name, inside)
