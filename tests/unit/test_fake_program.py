"""The fake runtime's built-in shell and scripted programs."""

import pytest

from backends.fake.program import ProgramError, ShellContext, parse_program, program_from_command, run_shell


@pytest.mark.parametrize(
    ("argv", "stdout", "stderr", "code"),
    [
        (["echo", "a", "b"], b"a b\n", b"", 0),
        (["echo", "-n", "x"], b"x", b"", 0),
        (["true"], b"", b"", 0),
        (["false"], b"", b"", 1),
        (["sh", "-c", "exit 7"], b"", b"", 7),
        (["sh", "-c", "echo a && false || echo b; exit 3"], b"a\nb\n", b"", 3),
        (["sh", "-c", "echo err >&2"], b"", b"err\n", 0),
        (["top"], b"", b"sh: top: not found\n", 127),
    ],
    ids=["echo", "echo-n", "true", "false", "exit", "chain", "stderr", "unknown"],
)
def test_shell(argv: list[str], stdout: bytes, stderr: bytes, code: int) -> None:
    r = run_shell(argv)
    assert (r.stdout, r.stderr, r.exit_code) == (stdout, stderr, code)


def test_sleep_accumulates() -> None:
    assert run_shell(["sh", "-c", "sleep 1; sleep 0.5"]).sleep == 1.5


def test_program_from_command() -> None:
    p = program_from_command(["sh", "-c", "echo hi; exit 2"])
    assert p is not None and p.exit_code == 2 and p.exit_after == 0 and p.output[0].line == "hi"
    assert program_from_command(["nginx"]) is None  # unknown: runs until stopped
    loop = program_from_command(["sh", "-c", "while true; do echo tick; sleep 2; done"])
    assert loop is not None and loop.repeat_every == 2 and loop.exit_after is None
    assert program_from_command(["sh", "-c", "while true; do echo spin; done"]) is None


def test_context_builtins() -> None:
    ctx = ShellContext(
        files={"/etc/resolv.conf": "nameserver 8.8.8.8\n"},
        sysctls={"kernel.shm_rmid_forced": "1"},
        processes=["sleep"],
    )
    assert run_shell(["cat", "/etc/resolv.conf"], ctx).stdout == b"nameserver 8.8.8.8\n"
    assert run_shell(["cat", "/nope"], ctx).exit_code == 1
    assert run_shell(["sysctl", "-n", "kernel.shm_rmid_forced"], ctx).stdout == b"1\n"
    assert run_shell(["sh", "-c", "pgrep sleep || true"], ctx).stdout == b"1\n"
    assert run_shell(["sh", "-c", "pgrep top || true"], ctx).stdout == b""


def test_parse_program() -> None:
    p = parse_program(
        '{"output": ["a", {"after": 1, "stream": "stderr", "line": "b"}], "exit_after": 2}', "t"
    )
    assert [o.line for o in p.output] == ["a", "b"] and p.finite
    with pytest.raises(ProgramError, match="stream"):
        parse_program('{"output": [{"stream": "stdin"}]}', "t")
    with pytest.raises(ProgramError, match="JSON"):
        parse_program("{", "t")
