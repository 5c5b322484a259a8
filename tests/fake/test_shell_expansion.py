"""Words expanded: parameters, command substitution, arithmetic, field splitting and patterns
(backends/fake/shell/expansion.py, words.py, arithmetic.py, patterns.py)."""

from __future__ import annotations

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
