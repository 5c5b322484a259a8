"""The shell's special builtins: exit, export, unset, cd, trap, read, command, exec, eval, ., shift...
(backends/fake/shell/builtins.py)."""

from __future__ import annotations

from tests.fake.harness import Row, check_script, script_table

TABLE: list[Row] = [
    ("exit 7", "", "", None, 7),
    ("exit 300", "", "", None, 44),
    ("false; exit", "", "", None, 1),
    ("exit nope", "", "", "Illegal number", 2),
    ("local x=1", "", "", "not in a function", 1),
    ("return 3", "", "", "can only return", 1),
    ("export Y=2; env | grep '^Y='", "", "Y=2\n", None, 0),
    ('unset HOME; echo "[${HOME-unset}]"', "", "[unset]\n", None, 0),
    ("cd /data; pwd; echo $PWD; cd ..; pwd; cd /nope", "", "/data\n/data\n/\n", "can't cd to /nope", 1),
    ("trap 'echo term' TERM; kill $$; echo after", "", "term\nafter\n", None, 0),
    ("trap 'echo cleanup' EXIT; echo work; exit 3", "", "work\ncleanup\n", None, 3),
    ("trap 'echo x' TERM; trap; trap - TERM; trap", "", "trap -- 'echo x' TERM\n", None, 0),
    ("trap 'echo x' NOSUCH", "", "", "bad trap", 1),
    ('read a b; echo "[$a][$b]"', "one two three\n", "[one][two three]\n", None, 0),
    ("read x; echo $? [$x]", "", "1 []\n", None, 0),
    ('while read l; do echo "<$l>"; done', "a\nb\n", "<a>\n<b>\n", None, 0),
    ('read -r x; echo "$x"; read y; echo "$y"', "a\\b\nc\\d\n", "a\\b\ncd\n", None, 0),
    (": ignored args; echo $?", "", "0\n", None, 0),
    (
        "command -v echo; command -v nope || echo none; type cd; which ls; f() { :; }; type f",
        "",
        "/bin/echo\nnone\ncd is a shell builtin\n/bin/ls\nf is a function\n",
        None,
        0,
    ),
    ("exec echo replaced; echo never", "", "replaced\n", None, 0),
    ("exec false", "", "", None, 1),
    ("cmd='echo evaluated'; eval \"$cmd\"; eval 'x=5'; echo $x", "", "evaluated\n5\n", None, 0),
    (". /data/lib.sh; echo $LIBVAR; libf a", "", "from-lib\nlibf a\n", None, 0),
    ("set -- a b c; shift; echo $# $1; shift 2; echo $#", "", "2 b\n0\n", None, 0),
    ("trap 'echo int' INT; kill -INT $$; kill -9 $$; echo no", "", "int\n", None, 137),
]


@script_table(TABLE)
async def test_script(script: str, stdin: str, stdout: str, stderr: str | None, code: int) -> None:
    await check_script(script, stdin, stdout, stderr, code)
