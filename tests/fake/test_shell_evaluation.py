"""Commands run: lists, pipelines, compound commands, functions, redirections and how names are
found (backends/fake/shell/evaluation.py, redirection.py)."""

from __future__ import annotations

import pytest

from tests.fake.harness import Harness, Row, check_script, default_fs, script_table

TABLE: list[Row] = [
    ("true && echo yes || echo no", "", "yes\n", None, 0),
    ("false && echo yes || echo no", "", "no\n", None, 0),
    ("! false && echo negated; ! true; echo $?", "", "negated\n1\n", None, 0),
    ("{ echo a; echo b; } > /tmp/f; cat /tmp/f", "", "a\nb\n", None, 0),
    ("(x=1; cd /data; exit 3); echo $? ${x:-unset} $(pwd)", "", "3 unset /\n", None, 0),
    ("(echo in-subshell; exit 1) || echo failed", "", "in-subshell\nfailed\n", None, 0),
    ("echo hello | tr a-z A-Z", "", "HELLO\n", None, 0),
    ("printf 'b\\na\\nb\\n' | grep b | wc -l", "", "2\n", None, 0),
    ("false | true; echo $?; true | false; echo $?", "", "0\n1\n", None, 0),
    ("set -o pipefail; false | true; echo $?", "", "1\n", None, 0),
    ("yes | head -n 2", "", "y\ny\n", None, 0),
    ('echo x | { read v; echo got-$v; }; echo "[${v-}]"', "", "got-x\n[]\n", None, 0),
    ("sleep 1 & wait; echo done", "", "done\n", None, 0),
    ("(exit 5) & wait $!; echo $?", "", "5\n", None, 0),
    ("sleep 100 & kill $!; wait $!; echo $?", "", "143\n", None, 0),
    ("wait 12345; echo $?", "", "127\n", None, 0),
    ("i=0; while [ $i -lt 3 ]; do echo $i; i=$((i+1)); done", "", "0\n1\n2\n", None, 0),
    ("i=0; until [ $i -ge 2 ]; do i=$((i+1)); echo u$i; done", "", "u1\nu2\n", None, 0),
    ("for x in a b c; do echo $x; done", "", "a\nb\nc\n", None, 0),
    ('set -- \'a b\' c; for x in "$@"; do echo "[$x]"; done', "", "[a b]\n[c]\n", None, 0),
    ("set -- 1 2; for x; do echo $x; done", "", "1\n2\n", None, 0),
    (
        "x=2; if [ $x = 1 ]; then echo one; elif [ $x = 2 ]; then echo two; else echo many; fi",
        "",
        "two\n",
        None,
        0,
    ),
    ("if false; then echo no; fi; echo $?", "", "0\n", None, 0),
    (
        "for f in a.txt b.log c; do case $f in *.txt) echo text;; *.log|*.out) echo log;; *) echo other;; esac; done",
        "",
        "text\nlog\nother\n",
        None,
        0,
    ),
    (
        "case x1 in [a-z]?) echo class;; esac; case '*' in \"*\") echo star;; esac",
        "",
        "class\nstar\n",
        None,
        0,
    ),
    ("case nope in a) echo a;; esac; echo $?", "", "0\n", None, 0),
    (
        "for i in 1 2 3 4; do [ $i = 2 ] && continue; [ $i = 4 ] && break; echo $i; done",
        "",
        "1\n3\n",
        None,
        0,
    ),
    (
        "for i in 1 2; do for j in a b; do [ $j = b ] && continue 2; echo $i$j; done; done",
        "",
        "1a\n2a\n",
        None,
        0,
    ),
    ("for i in 1 2; do for j in a b; do break 2; done; echo never; done; echo out", "", "out\n", None, 0),
    ('greet() { echo "hi $1 ($#)"; }; greet bob x', "", "hi bob (2)\n", None, 0),
    ('f() { echo "$@"; return 4; }; f a b; echo $?', "", "a b\n4\n", None, 0),
    (
        "fact() { if [ $1 -le 1 ]; then echo 1; else echo $(( $1 * $(fact $(($1-1))) )); fi; }; fact 5",
        "",
        "120\n",
        None,
        0,
    ),
    ("x=g; f() { local x=l; echo $x; }; f; echo $x", "", "l\ng\n", None, 0),
    ("X=1; echo $X", "", "1\n", None, 0),
    ('Z=3 printenv Z; echo "[${Z-}]"', "", "3\n[]\n", None, 0),
    ("set -e; echo a; false; echo b", "", "a\n", None, 1),
    ("set -e; if false; then :; fi; false || true; ! true; echo survived", "", "survived\n", None, 0),
    ("set -e; f() { false; echo no; }; f; echo never", "", "", None, 1),
    ("set -x; echo hi", "", "hi\n", "+ echo hi", 0),
    ("echo out > /tmp/o; echo more >> /tmp/o; cat /tmp/o", "", "out\nmore\n", None, 0),
    ("cat < /data/in.txt", "", "one\ntwo\nthree\n", None, 0),
    ("echo err 1>&2", "", "", "err\n", 0),
    ("echo err >&2; echo out", "", "out\n", "err\n", 0),
    ("{ echo o; echo e >&2; } 2>&1 | tr a-z A-Z", "", "O\nE\n", None, 0),
    ("nosuch 2>/dev/null; echo $?", "", "127\n", None, 0),
    ("echo gone >/dev/null; echo kept > /dev/stdout", "", "kept\n", None, 0),
    ("echo to-err > /dev/stderr", "", "", "to-err", 0),
    ("echo x > /missing/dir/f", "", "", "can't create /missing/dir/f", 1),
    ("cat < /nope; echo $?", "", "1\n", "can't open /nope", 0),
    ("exec > /tmp/log; echo hidden; cat /tmp/log >&2", "", "", "hidden", 0),
    ("/bin/echo a; /usr/bin/env | grep -c HOME", "", "a\n1\n", None, 0),
    ("frobnicate --x", "", "", "sh: frobnicate: not found", 127),
    ("exec 3>/tmp/x; echo fd3 >&3; cat /tmp/x", "", "fd3\n", None, 0),
    ("(trap 'echo sub-exit' EXIT; echo in); echo out", "", "in\nsub-exit\nout\n", None, 0),
]


@script_table(TABLE)
async def test_script(script: str, stdin: str, stdout: str, stderr: str | None, code: int) -> None:
    await check_script(script, stdin, stdout, stderr, code)


# --------------------------------------------------------------------------- pipelines


@pytest.mark.parametrize(
    ("script", "stdout"),
    [
        ("yes | head -n 3", b"y\ny\ny\n"),
        ("yes hello | head -n1", b"hello\n"),
        ("seq 1000000000 | head -n 2", b"1\n2\n"),
        ("while true; do echo x; done | head -n 2", b"x\nx\n"),
        ("yes | tr y n | grep -m 2 n", b"n\nn\n"),
        ("yes | head -c 4", b"y\ny\n"),
    ],
)
async def test_endless_producer_ends_when_its_reader_stops(script: str, stdout: bytes) -> None:
    result = await Harness().run(["sh", "-c", script + "; echo status=$?"])
    assert result.stdout == stdout + b"status=0\n"


async def test_pipeline_stage_status_is_sigpipe() -> None:
    result = await Harness().run(["sh", "-c", "set -o pipefail; yes | head -n1; echo $?"])
    assert result.stdout == b"y\n141\n"


# --------------------------------------------------------------------------- deep and long


async def test_twenty_thousand_iterations_complete() -> None:
    result = await Harness().run(["sh", "-c", "i=0; while [ $i -lt 20000 ]; do i=$((i+1)); done; echo $i"])
    assert (result.stdout, result.code) == (b"20000\n", 0)


async def test_endless_recursion_fails_with_a_message() -> None:
    result = await Harness().run(["sh", "-c", "f() { f; }; f; echo never"])
    assert result.code == 2 and b"nesting depth" in result.stderr and result.stdout == b""
    deep = await Harness().run(["sh", "-c", "f() { [ $1 -gt 0 ] && f $(($1 - 1)) || echo bottom; }; f 500"])
    assert deep.stdout == b"bottom\n"


# --------------------------------------------------------------------------- scripts in the files


async def test_scripts_in_the_fs_run_by_path_and_on_path() -> None:
    fs = default_fs()
    fs.mkdir("/scripts")
    fs.write("/scripts/run.sh", b'#!/bin/sh\necho "run $1 from $0"\nexit 3\n')
    fs.mkdir("/usr/local/bin", parents=True)
    fs.write("/usr/local/bin/helper", b"#!/usr/bin/env bash\necho helped\n")
    fs.write("/scripts/tool.py", b"#!/usr/bin/python3\nprint('no')\n")
    h = Harness(fs=fs)
    h.io.env["PATH"] = "/usr/local/bin:/bin"
    result = await h.run(["/scripts/run.sh", "a"])
    assert (result.stdout, result.code) == (b"run a from /scripts/run.sh\n", 3)
    result = await Harness(fs=fs).run(["sh", "-c", "PATH=/usr/local/bin; helper; /scripts/tool.py; echo $?"])
    assert result.stdout == b"helped\n126\n" and b"python3" in result.stderr
