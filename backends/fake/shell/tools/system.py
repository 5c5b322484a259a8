"""Tools that tell or change the system around the shell: true, false, sleep, date, nmeter, hostname, env,
printenv, uname, kill, pgrep, pidof, ps, which."""

from __future__ import annotations

import asyncio
import datetime
import re

from backends.fake.shell.builtins import true
from backends.fake.shell.control import ToolError
from backends.fake.shell.evaluation import Builtin, Shell
from backends.fake.shell.lexer import ASSIGNMENT
from backends.fake.shell.options import getopt, integer
from backends.fake.shell.process import SIGNALS, signal_name


async def _t_false(sh: Shell, argv: list[str]) -> int:
    return 1


_DURATION = re.compile(r"(\d+(?:\.\d*)?|\.\d+)([smhd]?)")
_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


async def _t_sleep(sh: Shell, argv: list[str]) -> int:
    """sleep N[smhd]... | infinity: on io.sleep; SIGTERM interrupts it."""
    if len(argv) < 2:
        raise ToolError("missing operand")
    total = 0.0
    for arg in argv[1:]:
        if arg in ("infinity", "inf"):
            await sh.sleep_forever()
        m = _DURATION.fullmatch(arg)
        if not m:
            raise ToolError(f"invalid number '{arg}'")
        total += float(m[1]) * _UNITS[m[2]]
    await sh.block(sh.io.sleep(total))
    return 0


_DATE_DEFAULT = "%a %b %e %H:%M:%S %Z %Y"
_STRFTIME = re.compile(r"%(.)", re.S)


def _strftime(moment: datetime.datetime, fmt: str) -> str:
    """strftime with date's %s, %N and the UTC %Z, %z, %e done here: the same on every platform."""

    def one(m: re.Match[str]) -> str:
        c = m.group(1)
        fixed = {
            "s": str(int(moment.timestamp())),
            "N": f"{moment.microsecond * 1000:09d}",
            "e": f"{moment.day:2d}",
            "Z": "UTC",
            "z": "+0000",
            "%": "%",
        }
        return fixed.get(c) or moment.strftime("%" + c)

    return _STRFTIME.sub(one, fmt)


def _date_value(text: str) -> float:
    if text.startswith("@"):
        try:
            return float(text[1:])
        except ValueError:
            pass
    try:
        moment = datetime.datetime.fromisoformat(text)
    except ValueError:
        raise ToolError(f"invalid date '{text}'") from None
    return (moment if moment.tzinfo else moment.replace(tzinfo=datetime.UTC)).timestamp()


async def _t_date(sh: Shell, argv: list[str]) -> int:
    """date [-u] [-d @N|ISO] [-I[seconds]|-R] [+FORMAT], always in UTC."""
    when, fmt = sh.io.clock(), _DATE_DEFAULT
    args = argv[1:]
    while args:
        arg = args.pop(0)
        if arg.startswith("+"):
            fmt = arg[1:]
        elif arg in ("-d", "--date") and args:
            when = _date_value(args.pop(0))
        elif arg.startswith("--date="):
            when = _date_value(arg[7:])
        elif arg in ("-I", "-Idate", "--iso-8601"):
            fmt = "%Y-%m-%d"
        elif arg.startswith(("-I", "--iso-8601")):
            fmt = "%Y-%m-%dT%H:%M:%S+00:00"
        elif arg in ("-R", "--rfc-2822", "--rfc-email"):
            fmt = "%a, %d %b %Y %H:%M:%S +0000"
        elif arg not in ("-u", "--utc", "--universal"):
            raise ToolError(f"invalid option '{arg}'")
    await sh.out(_strftime(datetime.datetime.fromtimestamp(when, datetime.UTC), fmt) + "\n")
    return 0


def _resolve(sh: Shell, name: str) -> tuple[str, list[str]]:
    """The canonical name and addresses of ``name`` as the resolver finds them in /etc/hosts (the
    kubelet's has ``IP  FQDN  SHORTNAME`` for a pod with a subdomain): the line's first name is the
    canonical one. Not found there: the name itself, and no address."""
    try:
        hosts = sh.io.fs.read("/etc/hosts").decode(errors="replace")
    except OSError:
        hosts = ""
    canonical, addresses = "", []
    for line in hosts.splitlines():
        fields = line.partition("#")[0].split()
        if len(fields) > 1 and name in fields[1:]:
            canonical = canonical or fields[1]
            addresses.append(fields[0])
    return canonical or name, addresses


_NMETER = re.compile(r"%(\d?)([a-z%])")


async def _t_nmeter(sh: Shell, argv: list[str]) -> int:
    """nmeter [-d MSEC] FORMAT: a line of FORMAT every MSEC (default 1000), until its reader goes.
    Only ``%t`` (the time of day, ``%3t`` with milliseconds: what the node e2e specs' timestamps
    are made of) and ``%%``; the system figures (``%c``, ``%m``...) the fake has none of print 0."""
    opts, rest = getopt(argv, "", "d")
    if len(rest) != 1:
        raise ToolError("usage: nmeter [-d MSEC] FORMAT", 1)
    delay = integer(opts.get("d", "1000"), "delay")

    def one(m: re.Match[str]) -> str:
        if m[2] == "%":
            return "%"
        if m[2] != "t":
            return "0"
        moment = datetime.datetime.fromtimestamp(sh.io.clock(), datetime.UTC)
        digits = int(m[1] or 0)
        fraction = f".{moment.microsecond:06d}"[: digits + 1] if digits else ""
        return moment.strftime("%H:%M:%S") + fraction

    while True:
        await sh.out(_NMETER.sub(one, rest[0]) + "\n")
        if delay > 0:
            await sh.block(sh.io.sleep(delay / 1000))
        else:
            await asyncio.sleep(0)  # a reader that never makes us wait must not starve the loop


async def _t_hostname(sh: Shell, argv: list[str]) -> int:
    """hostname [-s|-f|-d|-i]: the short name, or the canonical name, its domain or its addresses
    as /etc/hosts resolves the host name (busybox resolves it with gethostbyname)."""
    opts, rest = getopt(argv, "sfdi")
    if rest:
        raise ToolError("sethostname: Operation not permitted")
    name = sh.io.hostname
    if "s" in opts:
        name = name.split(".")[0]
    elif "f" in opts:
        name = _resolve(sh, name)[0]
    elif "d" in opts:
        name = _resolve(sh, name)[0].partition(".")[2]
    elif "i" in opts:
        name = " ".join(_resolve(sh, name)[1])
    await sh.out(name + "\n")
    return 0


async def _t_env(sh: Shell, argv: list[str]) -> int:
    """env [-i] [-u NAME] [NAME=VALUE]... [CMD [ARGS]]: prints the environment, or runs CMD in it."""
    env = sh.environ()
    args = argv[1:]
    while args and args[0].startswith("-"):
        arg = args.pop(0)
        if arg in ("-i", "-", "--ignore-environment"):
            env = {}
        elif arg == "-u" and args:
            env.pop(args.pop(0), None)
        elif arg == "--":
            break
        else:
            raise ToolError(f"invalid option '{arg}'", 125)
    while args and ASSIGNMENT.match(args[0]):
        name, _, value = args.pop(0).partition("=")
        env[name] = value
    if not args:
        await sh.out("".join(f"{n}={v}\n" for n, v in env.items()))
        return 0
    child = sh.fork()
    child.vars, child.exported = dict(env), set(env)
    return await child.external(args)


async def _t_printenv(sh: Shell, argv: list[str]) -> int:
    env = sh.environ()
    if len(argv) == 1:
        await sh.out("".join(f"{n}={v}\n" for n, v in env.items()))
        return 0
    values = [env[name] for name in argv[1:] if name in env]
    await sh.out("".join(v + "\n" for v in values))
    return 0 if len(values) == len(argv) - 1 else 1


_UNAME = {"s": "Linux", "r": "6.6.0-fake", "v": "#1 SMP PREEMPT_DYNAMIC", "m": "x86_64", "p": "unknown"}
_UNAME |= {"i": "unknown", "o": "GNU/Linux"}


async def _t_uname(sh: Shell, argv: list[str]) -> int:
    opts, _ = getopt(argv, "asnrvmpio")
    keys = "snrvmo" if "a" in opts else [k for k in "snrvmpio" if k in opts] or ["s"]
    await sh.out(" ".join(sh.io.hostname if k == "n" else _UNAME[k] for k in keys) + "\n")
    return 0


async def _t_kill(sh: Shell, argv: list[str]) -> int:
    """kill [-s SIG|-SIG] PID...: $$ signals this shell; a background job's pid stops it."""
    args = argv[1:]
    if args == ["-l"]:
        await sh.out(" ".join(n for n in SIGNALS if n != "EXIT") + "\n")
        return 0
    name: str | None = "TERM"
    if args[:1] == ["-s"] and len(args) > 1:
        name, args = signal_name(args[1]), args[2:]
    elif args and args[0].startswith("-") and args[0] != "--" and len(args[0]) > 1:
        name, args = signal_name(args[0][1:]), args[1:]
    args = args[1:] if args[:1] == ["--"] else args
    if name is None:
        raise ToolError("bad signal name")
    if not args:
        raise ToolError("usage: kill [-s SIGNAL | -SIGNAL] PID...", 2)
    for arg in args:
        pid = integer(arg, "pid")
        if name != "EXIT":  # signal 0: only asks whether the process exists
            await sh.kill(pid, name)
    return 0


async def _t_pgrep(sh: Shell, argv: list[str]) -> int:
    """pgrep [-flx] PATTERN over the processes of the container's PID namespace (io.processes)."""
    opts, patterns = getopt(argv, "flxa")
    if len(patterns) != 1:
        raise ToolError("usage: pgrep [-flx] PATTERN", 2)
    try:
        regex = re.compile(patterns[0])
    except re.error as exc:
        raise ToolError(f"bad regex: {exc}", 2) from None
    match = regex.fullmatch if "x" in opts else regex.search
    hits = [(pid, name) for pid, name in sh.processes() if match(name)]
    await sh.out("".join(f"{pid} {name}\n" if "l" in opts else f"{pid}\n" for pid, name in hits))
    return 0 if hits else 1


async def _t_pidof(sh: Shell, argv: list[str]) -> int:
    """pidof [-s] [-o PID] NAME...: the PIDs of the processes named so, newest first, on one line."""
    opts, names = getopt(argv, "s", "o")
    omit = {integer(p, "pid") for p in opts.get("o", "").split("\n") if p and p != "%PPID"}
    wanted = {name.rsplit("/", 1)[-1] for name in names}
    pids = [pid for pid, name in reversed(sh.processes()) if name in wanted and pid not in omit]
    if "s" in opts:
        pids = pids[:1]
    if pids:
        await sh.out(" ".join(map(str, pids)) + "\n")
    return 0 if pids else 1


async def _t_ps(sh: Shell, argv: list[str]) -> int:
    rows = "".join(f"{pid:>5} root      0:00 {name}\n" for pid, name in sh.processes())
    await sh.out("  PID USER     TIME  COMMAND\n" + rows)
    return 0


async def _t_which(sh: Shell, argv: list[str]) -> int:
    status = 0
    for name in (a for a in argv[1:] if not a.startswith("-")):
        found = sh.describe(name)
        if found is not None and found[0] == "file":
            await sh.out(found[1] + "\n")
        else:
            status = 1
    return status


COMMANDS: dict[str, Builtin] = {
    "true": true,
    "false": _t_false,
    "sleep": _t_sleep,
    "date": _t_date,
    "nmeter": _t_nmeter,
    "hostname": _t_hostname,
    "env": _t_env,
    "printenv": _t_printenv,
    "uname": _t_uname,
    "kill": _t_kill,
    "pgrep": _t_pgrep,
    "pidof": _t_pidof,
    "ps": _t_ps,
    "which": _t_which,
}
