"""The fake runtime's built-in shell and scripted programs."""

import pytest

from backends.fake.program import ProgramError, parse_program, program_from_command, run_shell


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
    p = program_from_command(["sh", "-c", "echo hi; exit 2"], {}, "h")
    assert p is not None and p.exit_code == 2 and p.exit_after == 0 and p.output[0].line == "hi"
    assert program_from_command(["nginx"], {}, "h") is None  # unknown: runs until stopped


def test_parse_program() -> None:
    p = parse_program(
        '{"output": ["a", {"after": 1, "stream": "stderr", "line": "b"}], "exit_after": 2}', "t"
    )
    assert [o.line for o in p.output] == ["a", "b"] and p.finite
    with pytest.raises(ProgramError, match="stream"):
        parse_program('{"output": [{"stream": "stdin"}]}', "t")
    with pytest.raises(ProgramError, match="JSON"):
        parse_program("{", "t")
