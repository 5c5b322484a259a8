"""Control flow that leaves commands early (exit, return, break, continue, signals, a broken pipe),
and the errors that end a command or a shell."""

from __future__ import annotations


class Unwind(Exception):
    """Control flow that leaves commands early; code is an exit status or a loop count."""

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


class Exit(Unwind):
    """`exit N`: ends the current shell (a subshell's ends at its parenthesis)."""


class Return(Unwind):
    """`return N` from a function or a sourced file."""


class Break(Unwind):
    """`break N`."""


class Continue(Unwind):
    """`continue N`."""


class Terminated(Unwind):
    """A signal ends the shell that takes signals: TERM with no trap, or `exit` in its trap."""


class Interrupted(Exception):
    """SIGTERM interrupted a blocking command (sleep, wait, a read); the trap runs after it."""


class BrokenPipe(Exception):
    """The reader of a pipe is gone: the writing stage ends, as SIGPIPE would end it."""


class ShellError(Exception):
    """An error that ends the (sub)shell, as a failed expansion does in a non-interactive sh."""

    def __init__(self, message: str, code: int = 2) -> None:
        super().__init__(message)
        self.code = code


class ToolError(Exception):
    """A command's usage or runtime error, printed as "NAME: message" with its exit status."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


def propagate(jump: Break | Continue) -> None:
    """Re-raises `break N`/`continue N` for the enclosing loop when N > 1."""
    if jump.code > 1:
        raise type(jump)(jump.code - 1)


_REASONS: tuple[tuple[type[OSError], str], ...] = (
    (FileNotFoundError, "No such file or directory"),
    (IsADirectoryError, "Is a directory"),
    (NotADirectoryError, "Not a directory"),
    (FileExistsError, "File exists"),
    (PermissionError, "Permission denied"),
)


def reason(exc: OSError) -> str:
    """The strerror a tool prints for a failed file operation."""
    if exc.strerror:
        return exc.strerror
    return next((text for kind, text in _REASONS if isinstance(exc, kind)), str(exc) or "I/O error")
