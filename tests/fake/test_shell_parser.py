"""The shell's lexer and parser (backends/fake/shell/lexer.py, parser.py, syntax.py)."""

from __future__ import annotations

import pytest

from backends.fake.shell.lexer import ParseError
from backends.fake.shell.parser import parse
from backends.fake.shell.syntax import (
    AndOr,
    Case,
    For,
    FuncDef,
    Group,
    If,
    Lit,
    Loop,
    Pipeline,
    Redirected,
    Seq,
    Simple,
    Subshell,
    Subst,
)
from tests.fake.harness import Harness, Row, check_script, script_table

TABLE: list[Row] = [
    ("echo a; echo b", "", "a\nb\n", None, 0),
    ("echo a\necho b\n\n", "", "a\nb\n", None, 0),
    ("echo a # a comment\n# a line of comment\necho b", "", "a\nb\n", None, 0),
    ("echo a \\\n  b", "", "a b\n", None, 0),
    ("echo '$HOME \"q\"'", "", '$HOME "q"\n', None, 0),
    ('echo "$HOME and \\$HOME"', "", "/root and $HOME\n", None, 0),
    ("echo a\\ b\\$c", "", "a b$c\n", None, 0),
    ("cat <<EOF\nhome=$HOME sum=$((1+1))\nEOF", "", "home=/root sum=2\n", None, 0),
    ("cat <<'EOF'\n$HOME $(x)\nEOF", "", "$HOME $(x)\n", None, 0),
    ("if true; then echo x", "", "", "sh: syntax error", 2),
    ("echo a ;; echo b", "", "", "sh: syntax error", 2),
    (
        "command -v nope &>/dev/null || echo missing; ls /nope &>> /tmp/log; grep -c nope /tmp/log",
        "",
        "missing\n1\n",
        None,
        0,
    ),
    ('read a b <<< "x y"; echo $b$a', "", "yx\n", None, 0),
    ("function f { echo in-f $1; }; f x", "", "in-f x\n", None, 0),
    ('x=$(cat <<EOF\ninside\nEOF\n); echo "[$x]"', "", "[inside]\n", None, 0),
]


@script_table(TABLE)
async def test_script(script: str, stdin: str, stdout: str, stderr: str | None, code: int) -> None:
    await check_script(script, stdin, stdout, stderr, code)


async def test_heredocs() -> None:
    script = """
name=world
cat <<EOF
hello $name $((6*7)) $(echo sub) \\$name
EOF
cat <<'EOF'
literal $name $(echo no)
EOF
cat <<"EOF"
quoted $name
EOF
	cat <<-EOF
	tabs stripped $name
	EOF
while read a b; do echo "$b-$a"; done <<EOF
1 one
2 two
EOF
f() { cat; }
f <<X
in a function
X
cat <<A; cat <<B
first
A
second
B
"""
    result = await Harness().run(["sh", "-c", script])
    assert result.stdout.decode() == (
        "hello world 42 sub $name\n"
        "literal $name $(echo no)\n"
        "quoted $name\n"
        "tabs stripped world\n"
        "one-1\ntwo-2\n"
        "in a function\n"
        "first\nsecond\n"
    )
    assert result.code == 0


@pytest.mark.parametrize(
    ("script", "kind"),
    [
        ("echo a", Simple),
        ("a | b", Pipeline),
        ("! a", Pipeline),
        ("a && b || c", AndOr),
        ("a; b &", Seq),
        ("{ a; }", Group),
        ("(a)", Subshell),
        ("if a; then b; fi", If),
        ("until a; do b; done", Loop),
        ("for x in 1 2; do b; done", For),
        ("case x in a) b;; esac", Case),
        ("f() { a; }", FuncDef),
        ("{ a; } > /f", Redirected),
    ],
    ids=lambda v: v if isinstance(v, str) else v.__name__,
)
def test_a_script_parses_into_its_command(script: str, kind: type) -> None:
    # A list or pipeline of one command is that command: evaluation walks no empty levels.
    assert type(parse(script)) is kind


def test_substitutions_hold_their_commands_and_the_word_goes_on_after_them() -> None:
    node = parse('echo $(a | b)x `c; d` "$(e)"')
    assert isinstance(node, Simple)
    first, second, third = (word.parts for word in node.words[1:])
    assert isinstance(first[0], Subst) and isinstance(first[0].body, Pipeline) and not first[0].quoted
    assert first[1:] == (Lit("x", False),)
    assert isinstance(second[0], Subst) and isinstance(second[0].body, Seq)
    assert isinstance(third[0], Subst) and isinstance(third[0].body, Simple) and third[0].quoted


@pytest.mark.parametrize(
    ("script", "incomplete"),
    [
        ("echo 'open", True),
        ("if true; then", True),
        ("echo $(a", True),
        ("echo ${x", True),
        ("echo a ;; b", False),
        ("fi", False),
    ],
)
def test_a_syntax_error_tells_whether_more_input_could_complete_it(script: str, incomplete: bool) -> None:
    # `sh` reading stdin waits for the next line on an incomplete script and fails on the others.
    with pytest.raises(ParseError) as raised:
        parse(script)
    assert raised.value.incomplete is incomplete
