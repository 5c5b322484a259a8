"""Words expanded: parameters, command substitution, arithmetic, field splitting and patterns
(backends/fake/shell/expansion.py, words.py, arithmetic.py, patterns.py)."""

from __future__ import annotations

import re

import pytest

from backends.fake.shell.arithmetic import arith_compile
from backends.fake.shell.patterns import glob, posix_regex
from tests.fake.harness import Row, check_script, script_table

TABLE: list[Row] = [
    ("echo ${HOME}x $GREETING", "", "/rootx hello world\n", None, 0),
    ('echo ${NOPE:-dflt} ${HOME:-x} "${E-}"', "", "dflt /root \n", None, 0),
    ("echo ${u:=set}; echo $u ${u:+alt} ${v:+alt}.", "", "set\nset alt .\n", None, 0),
    (
        "x=/a/b/c.tar.gz; echo ${#x} ${x%.*} ${x%%.*} ${x##*/} ${x#*/}",
        "",
        "13 /a/b/c.tar /a/b/c c.tar.gz a/b/c.tar.gz\n",
        None,
        0,
    ),
    ("echo ${missing:?is required}; echo never", "", "", "missing: is required", 2),
    ("false; echo $?; true; echo $?", "", "1\n0\n", None, 0),
    ("echo $$ $0 $#", "", "1 sh 0\n", None, 0),
    ('set -- a b; echo "$*"; IFS=,; echo "$*"', "", "a b\na,b\n", None, 0),
    ('echo "$(echo a; echo b)" `echo c`', "", "a\nb c\n", None, 0),
    ("x=$(printf 'v\\n\\n'); echo \"[$x]\"", "", "[v]\n", None, 0),
    ("echo $(echo $(echo deep))", "", "deep\n", None, 0),
    ("x=$(false); echo $?", "", "1\n", None, 0),
    (
        "echo $((1 + 2 * 3)) $((10 / 3)) $((-7 % 3)) $((2 > 1)) $(( (1+2) * 3 )) $((0x10)) $((2**8))",
        "",
        "7 3 -1 1 9 16 256\n",
        None,
        0,
    ),
    ("a=5; echo $((a * 2)) $((a += 1)) $a $((a == 6 ? 10 : 20)) $((b++)) $b", "", "10 6 6 10 0 1\n", None, 0),
    ("echo $((1/0)); echo never", "", "", "division by zero", 2),
    (
        'x=\'a  b   c\'; for w in $x; do echo "<$w>"; done; echo "$x"',
        "",
        "<a>\n<b>\n<c>\na  b   c\n",
        None,
        0,
    ),
    ('e=; set -- $e "$e"; echo $#', "", "1\n", None, 0),
    ("IFS=:; x=a:b::c; set -- $x; echo $# $3.", "", "4 .\n", None, 0),
    ("echo * /data/*", "", "* /data/*\n", None, 0),
    (
        "echo $((2**63)) $((7 & 3)) $((1 << 4)) $((!0)) $((010))",
        "",
        "-9223372036854775808 3 16 1 8\n",
        None,
        0,
    ),
]


@script_table(TABLE)
async def test_script(script: str, stdin: str, stdout: str, stderr: str | None, code: int) -> None:
    await check_script(script, stdin, stdout, stderr, code)


class Variables:
    """The shell's variables as arithmetic sees them."""

    def __init__(self, **values: str) -> None:
        self.vars = dict(values)

    def get(self, name: str) -> str | None:
        return self.vars.get(name)


@pytest.mark.parametrize(
    ("expression", "value", "assigned"),
    [
        ("1 + 2 * 3", 7, {}),
        ("x += 2", 7, {"x": "7"}),
        ("x++ + x", 11, {"x": "6"}),
        ("y = x > 4 ? 0x10 : 010", 16, {"y": "16"}),
        ("-7 / 2", -3, {}),
        ("1 << 65", 2, {}),
        ("unset_name * 3", 0, {}),
    ],
)
def test_arithmetic_reads_and_assigns_variables(
    expression: str, value: int, assigned: dict[str, str]
) -> None:
    scope = Variables(x="5")
    assert arith_compile(expression)(scope) == value
    assert scope.vars == {"x": "5", **assigned}


@pytest.mark.parametrize(
    ("pattern", "text", "matches"),
    [
        ("*.txt", "a.txt", True),
        ("*.txt", "a.txt.log", False),
        ("[!a]?", "b1", True),
        ("[!a]?", "a1", False),
        ("[[:digit:]]*", "1x", True),
        ("\\*", "*", True),
        ("\\*", "a", False),
    ],
)
def test_shell_patterns(pattern: str, text: str, matches: bool) -> None:
    assert (glob(pattern).fullmatch(text) is not None) is matches


@pytest.mark.parametrize(
    ("pattern", "extended", "text", "found"),
    [
        ("a\\{2\\}", False, "xaab", True),
        ("a{2}", False, "a{2}", True),
        ("a{2}", True, "a{2}", False),
        ("\\(ab\\)*c$", False, "ababc", True),
        ("a|b", False, "b", False),
        ("a|b", True, "b", True),
        ("\\<ab\\>", False, "x abc", False),
        ("*a", False, "*a", True),
        ("[^[:space:]]", False, " \t", False),
    ],
)
def test_posix_regular_expressions(pattern: str, extended: bool, text: str, found: bool) -> None:
    assert (re.search(posix_regex(pattern, extended), text) is not None) is found
