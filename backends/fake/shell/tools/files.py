"""Tools over io.fs: pwd, ls, mkdir, touch, rm, cp, mv."""

from __future__ import annotations

import errno
import posixpath
from collections.abc import Callable

from backends.fake.shell.control import ToolError, reason
from backends.fake.shell.evaluation import Builtin, Shell
from backends.fake.shell.fs import Fs, norm
from backends.fake.shell.options import getopt


async def _t_pwd(sh: Shell, argv: list[str]) -> int:
    await sh.out(sh.cwd + "\n")
    return 0


def _ls_entry(fs: Fs, name: str, path: str, long: bool) -> str:
    if not long:
        return name
    if fs.is_dir(path):
        return f"drwxr-xr-x 2 root root 4096 {name}"
    try:
        size = len(fs.read(path))
    except OSError:
        size = 0
    return f"-rw-r--r-- 1 root root {size} {name}"


async def _t_ls(sh: Shell, argv: list[str]) -> int:
    """ls [-1aAdlr] [PATH...]: one name per line (-l: a short long format); dot files hidden."""
    opts, names = getopt(argv, "1aAdlrFhCtS")
    fs, long = sh.io.fs, "l" in opts
    status, lines, dirs = 0, [], []
    for name in names or ["."]:
        path = sh.abspath(name)
        if not fs.exists(path):
            await sh.err(f"ls: {name}: No such file or directory")
            status = 1
        elif fs.is_dir(path) and "d" not in opts:
            dirs.append((name, path))
        else:
            lines.append(_ls_entry(fs, name, path, long))
    for name, path in dirs:
        entries = fs.listdir(path)
        if "a" in opts:
            entries = [".", "..", *entries]
        elif "A" not in opts:
            entries = [e for e in entries if not e.startswith(".")]
        if "r" in opts:
            entries.reverse()
        if len(names) > 1:
            lines.extend([""] if lines else [])
            lines.append(f"{name}:")
        lines.extend(_ls_entry(fs, e, posixpath.join(path, e), long) for e in entries)
    await sh.out("".join(line + "\n" for line in lines))
    return status


async def _per_path(
    sh: Shell, names: list[str], skip: Callable[[str], bool], act: Callable[[str], None], failed: str
) -> int:
    """Apply ``act`` to each named path not ``skip``-ped; a failure says ``failed`` (with {name})
    and makes the status 1, the rest still go on."""
    status = 0
    for name in names:
        path = sh.abspath(name)
        if skip(path):
            continue
        try:
            act(path)
        except OSError as exc:
            await sh.err(f"{failed.format(name=name)}: {reason(exc)}")
            status = 1
    return status


async def _t_mkdir(sh: Shell, argv: list[str]) -> int:
    opts, names = getopt(argv, "pv", "m")
    if not names:
        raise ToolError("missing operand")
    parents = "p" in opts
    fs = sh.io.fs
    return await _per_path(
        sh,
        names,
        lambda path: parents and fs.is_dir(path),
        lambda path: fs.mkdir(path, parents=parents),
        "mkdir: can't create directory '{name}'",
    )


async def _t_touch(sh: Shell, argv: list[str]) -> int:
    """touch FILE...: creates missing files (io.fs has no times to update)."""
    opts, names = getopt(argv, "acm", "dtr")
    if not names:
        raise ToolError("missing operand")
    fs = sh.io.fs
    return await _per_path(
        sh,
        names,
        lambda path: "c" in opts or fs.exists(path),
        lambda path: fs.write(path, b"", append=True),
        "touch: {name}",
    )


def _remove_tree(fs: Fs, path: str) -> None:
    if fs.is_dir(path):
        for name in fs.listdir(path):
            _remove_tree(fs, posixpath.join(path, name))
    fs.remove(path)


def _copy_tree(fs: Fs, source: str, target: str) -> None:
    if not fs.is_dir(source):
        fs.write(target, fs.read(source))
        return
    if target == source or target.startswith(source.rstrip("/") + "/"):
        raise OSError(errno.EINVAL, "cannot copy a directory into itself")
    if not fs.is_dir(target):
        fs.mkdir(target)
    for name in fs.listdir(source):
        _copy_tree(fs, posixpath.join(source, name), posixpath.join(target, name))


async def _t_rm(sh: Shell, argv: list[str]) -> int:
    opts, names = getopt(argv, "fFrRiIdv")
    force, recursive = "f" in opts, "r" in opts or "R" in opts
    if not names and not force:
        raise ToolError("missing operand")
    status = 0
    for name in names:
        path = sh.abspath(name)
        if not sh.io.fs.exists(path):
            if not force:
                await sh.err(f"rm: can't remove '{name}': No such file or directory")
                status = 1
            continue
        if sh.io.fs.is_dir(path) and not recursive:
            await sh.err(f"rm: '{name}' is a directory")
            status = 1
            continue
        try:
            _remove_tree(sh.io.fs, path)
        except OSError as exc:
            await sh.err(f"rm: can't remove '{name}': {reason(exc)}")
            status = 1
    return status


async def _copy_or_move(sh: Shell, tool: str, names: list[str], recursive: bool, move: bool) -> int:
    if len(names) < 2:
        raise ToolError("missing file operand")
    fs = sh.io.fs
    *sources, target = names
    destination = sh.abspath(target)
    into = fs.is_dir(destination)
    if len(sources) > 1 and not into:
        raise ToolError(f"target '{target}' is not a directory")
    status = 0
    for name in sources:
        source = sh.abspath(name)
        to = norm(posixpath.join(destination, posixpath.basename(source))) if into else destination
        try:
            if fs.is_dir(source) and not recursive:
                raise IsADirectoryError(errno.EISDIR, "omitting directory")
            if to != source:
                _copy_tree(fs, source, to)
                if move:
                    _remove_tree(fs, source)
        except OSError as exc:
            await sh.err(f"{tool}: {name}: {reason(exc)}")
            status = 1
    return status


async def _t_cp(sh: Shell, argv: list[str]) -> int:
    opts, names = getopt(argv, "fpraRdvnLPHT")
    return await _copy_or_move(sh, "cp", names, recursive=bool(set(opts) & set("raR")), move=False)


async def _t_mv(sh: Shell, argv: list[str]) -> int:
    _, names = getopt(argv, "fivnT")
    return await _copy_or_move(sh, "mv", names, recursive=True, move=True)


COMMANDS: dict[str, Builtin] = {
    "pwd": _t_pwd,
    "ls": _t_ls,
    "mkdir": _t_mkdir,
    "touch": _t_touch,
    "rm": _t_rm,
    "cp": _t_cp,
    "mv": _t_mv,
}
