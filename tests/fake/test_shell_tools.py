"""The shell's programs: echo, printf, cat, head, grep, test, date, ls, kill, sh...
(backends/fake/shell/tools/)."""

from __future__ import annotations

from tests.fake.harness import Row, check_script, script_table

TABLE: list[Row] = [
    ("echo -n a; echo -e 'b\\tc\\x41'; echo '\\t'", "", "ab\tcA\n\\t\n", None, 0),
    (
        "printf '%s=%d %x %% [%5s] [%-3s] %03d\\n' a 42 255 r l 7",
        "",
        "a=42 ff % [    r] [l  ] 007\n",
        None,
        0,
    ),
    ("printf '%s,' a b c; printf '\\n'; printf '%d\\n' nope", "", "a,b,c,\n0\n", "invalid number", 1),
    ("cat /data/in.txt /etc/hostname", "", "one\ntwo\nthree\npod-1\n", None, 0),
    ("cat - /etc/hostname", "piped\n", "piped\npod-1\n", None, 0),
    ("cat /nope; echo $?", "", "1\n", "No such file or directory", 0),
    (
        "head -n 2 /data/in.txt; head -1 /data/in.txt; head -c 3 /data/in.txt; echo",
        "",
        "one\ntwo\none\none\n",
        None,
        0,
    ),
    (
        "tail -n 1 /data/in.txt; tail -2 /data/in.txt; tail -n +3 /data/in.txt; tail -c 4 /data/in.txt",
        "",
        "three\ntwo\nthree\nthree\nree\n",
        None,
        0,
    ),
    ("head -n 1; cat", "first\nsecond\n", "first\nsecond\n", None, 0),
    (
        "wc -l < /data/in.txt; wc -c /etc/hostname; printf 'a b\\nc' | wc -w",
        "",
        "3\n6 /etc/hostname\n3\n",
        None,
        0,
    ),
    (
        "grep -q two /data/in.txt && echo q; grep -v o /data/in.txt; grep -ic ONE /data/in.txt",
        "",
        "q\nthree\n1\n",
        None,
        0,
    ),
    (
        "printf 'ab\\naab\\nb\\n' | grep 'a\\{2\\}'; printf 'ab\\naab\\n' | grep -E '^a+b$' | wc -l",
        "",
        "aab\n2\n",
        None,
        0,
    ),
    (
        "echo 'a.b axb' | grep -oF a.b; grep -n t /data/in.txt; grep x /data/in.txt; echo $?",
        "",
        "a.b\n2:two\n3:three\n1\n",
        None,
        0,
    ),
    ("grep one /data/in.txt /nope; echo $?", "", "/data/in.txt:one\n2\n", "grep: /nope", 0),
    ("sleep 0.5; sleep 1s 2; sleep 1m & echo slept", "", "slept\n", None, 0),
    ("sleep abc", "", "", "invalid number", 1),
    ("true; echo $?; false; echo $?", "", "0\n1\n", None, 0),
    (
        "test -f /data/in.txt && [ -d /data ] && [ -e /etc ] && [ -s /data/in.txt ] && [ ! -s /data/empty ] && echo f",
        "",
        "f\n",
        None,
        0,
    ),
    (
        "[ -z '' ] && [ -n x ] && [ a = a ] && [ a != b ] && [ 2 -gt 1 ] && [ 1 -le 1 ] && [ 3 -ge 3 ] && echo ok",
        "",
        "ok\n",
        None,
        0,
    ),
    (
        "[ 0 -lt 1 -a 5 -eq 5 ] && [ ! 1 -ne 1 ] && [ \\( x = y \\) -o 1 = 1 ] && echo ok; [ -f /nope ]; echo $?",
        "",
        "ok\n1\n",
        None,
        0,
    ),
    ("[ x -lt 1 ]; echo $?", "", "2\n", "integer expression expected", 0),
    ("[ a = a; echo $?", "", "2\n", "missing ]", 0),
    (
        "date; date +%s; date -u +%Y-%m-%d; date -d @0 +%F",
        "",
        "Tue Dec  1 12:00:00 UTC 2026\n1796126400\n2026-12-01\n1970-01-01\n",
        None,
        0,
    ),
    (
        "hostname; uname; uname -n; id; id -u; whoami",
        "",
        "pod-1\nLinux\npod-1\nuid=0(root) gid=0(root) groups=0(root)\n0\nroot\n",
        None,
        0,
    ),
    (
        "printenv HOSTNAME; env | grep GREETING; printenv NOPE; echo $?",
        "",
        "pod-1\nGREETING=hello world\n1\n",
        None,
        0,
    ),
    ("ls /data; ls /nope", "", "empty\nin.txt\nlib.sh\n", "No such file", 1),
    (
        "mkdir -p /w/a/b; touch /w/f; ls /w; rm /w/f; rm -r /w/a; ls /w; rm -f /w/zzz; rm /w/zzz",
        "",
        "a\nf\n",
        "can't remove",
        1,
    ),
    ("mkdir /x/y", "", "", "can't create directory", 1),
    ("mkdir /d; rm /d; echo $?", "", "1\n", "is a directory", 0),
    ("cp /data/in.txt /tmp/c; mv /tmp/c /tmp/d; head -n1 /tmp/d; ls /tmp", "", "one\nd\n", None, 0),
    ("seq 3; seq 2 2 6 | tr '\\n' ' '; echo; seq -s , 1 3", "", "1\n2\n3\n2 4 6 \n1,2,3\n", None, 0),
    ("yes ok | head -n 2", "", "ok\nok\n", None, 0),
    ("basename /a/b.txt .txt; basename /a/b/; dirname /a/b; dirname file", "", "b\nb\n/a\n.\n", None, 0),
    (
        "echo hello | tr a-y b-z; echo hello | tr -d l; echo aaabbb | tr -s ab; echo Hi | tr '[:lower:]' '[:upper:]'",
        "",
        "ifmmp\nheo\nab\nHI\n",
        None,
        0,
    ),
    ("echo a; kill -TERM 1; echo never", "", "a\n", None, 143),
    ("kill 999; echo $?", "", "0\n", None, 0),
    ("sh -c 'echo $0:$1; exit 4' me arg; echo $?", "", "me:arg\n4\n", None, 0),
    ("X=outer; export E=exp; sh -c 'echo [$X][$E]; X=inner'; echo $X", "", "[][exp]\nouter\n", None, 0),
    ("pgrep nginx; pgrep nope; echo $?", "", "2\n1\n", None, 0),
    (
        "printf 'b\\na\\nb\\n' | sort -u; printf '10\\n9\\n' | sort -n; env | sort | head -n 1",
        "",
        "a\nb\n9\n10\nGREETING=hello world\n",
        None,
        0,
    ),
    ("seq 512 | wc -l; seq 5 | tail -c 4", "", "512\n4\n5\n", None, 0),
]


@script_table(TABLE)
async def test_script(script: str, stdin: str, stdout: str, stderr: str | None, code: int) -> None:
    await check_script(script, stdin, stdout, stderr, code)
