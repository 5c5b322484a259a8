"""The shell's lexer and parser (backends/fake/shell/lexer.py, parser.py, syntax.py)."""

from __future__ import annotations

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
