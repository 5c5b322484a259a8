"""The fake runtime's scripted programs (its shell: test_shell_*.py)."""

import pytest

from backends.fake.program import ProgramError, parse_program


def test_parse_program() -> None:
    p = parse_program(
        '{"output": ["a", {"after": 1, "stream": "stderr", "line": "b"}], "exit_after": 2}', "t"
    )
    assert [o.line for o in p.output] == ["a", "b"] and p.finite
    with pytest.raises(ProgramError, match="stream"):
        parse_program('{"output": [{"stream": "stdin"}]}', "t")
    with pytest.raises(ProgramError, match="JSON"):
        parse_program("{", "t")
