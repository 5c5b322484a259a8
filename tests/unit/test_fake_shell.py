"""The fake runtime's shell interpreter (backends/fake/shell.py)."""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
from collections.abc import Awaitable, Callable, Iterable

import pytest

from backends.fake.shell import MemoryFs, ShellIO, run, run_script

NOW = datetime.datetime(2026, 12, 1, 12, tzinfo=datetime.UTC).timestamp()
ENV = {"PATH": "/usr/bin:/bin", "HOME": "/root", "HOSTNAME": "pod-1", "GREETING": "hello world"}


@dataclasses.dataclass
class Result:
    stdout: bytes
    stderr: bytes
    code: int


class Harness:
    """One container's io for the shell: collected output, a scripted stdin and a fake clock."""

    def __init__(
        self,
        stdin: Iterable[bytes] | None = (),
        fs: MemoryFs | None = None,
        sleep: Callable[[float], Awaitable[None]] | None = None,
    ) -> None:
        self.stdout = bytearray()
        self.stderr = bytearray()
        self.slept: list[float] = []
        self.term = asyncio.Event()
        self.fs = fs if fs is not None else default_fs()
        self._chunks = list(stdin) if stdin is not None else None
        self.io = ShellIO(
            self.fs,
            dict(ENV),
            hostname="pod-1",
            stdin=self._read if stdin is not None else None,
            stdout=self._out,
            stderr=self._err,
            term=self.term,
            sleep=sleep or self._sleep,
            processes=lambda: ["sh", "nginx"],
            clock=lambda: NOW,
        )

    async def _read(self) -> bytes:
        assert self._chunks is not None
        return self._chunks.pop(0) if self._chunks else b""

    async def _out(self, data: bytes) -> None:
        self.stdout += data

    async def _err(self, data: bytes) -> None:
        self.stderr += data

    async def _sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        await asyncio.sleep(0)

    async def run(self, argv: list[str]) -> Result:
        code = await asyncio.wait_for(run(argv, self.io), 10)
        return Result(bytes(self.stdout), bytes(self.stderr), code)


def default_fs() -> MemoryFs:
    fs = MemoryFs(
        {
            "/etc/hostname": "pod-1\n",
            "/data/in.txt": "one\ntwo\nthree\n",
            "/data/empty": "",
            "/data/lib.sh": "LIBVAR=from-lib\nlibf() { echo libf $1; }\n",
        }
    )
    fs.mkdir("/tmp")
    return fs


async def blocked_forever(seconds: float) -> None:
    """A sleep that only SIGTERM (or cancellation) ends: TERM tests need no real time."""
    await asyncio.Event().wait()


async def settle() -> None:
    """Lets the shell run until it blocks."""
    for _ in range(20):
        await asyncio.sleep(0)


# (script, stdin, stdout, a substring of stderr or None for no stderr at all, exit code)
TABLE: list[tuple[str, str, str, str | None, int]] = [
    # sequences, && || !, groups, subshells, exit
    ("echo a; echo b", "", "a\nb\n", None, 0),
    ("echo a\necho b\n\n", "", "a\nb\n", None, 0),
    ("echo a # a comment\n# a line of comment\necho b", "", "a\nb\n", None, 0),
    ("echo a \\\n  b", "", "a b\n", None, 0),
    ("true && echo yes || echo no", "", "yes\n", None, 0),
    ("false && echo yes || echo no", "", "no\n", None, 0),
    ("! false && echo negated; ! true; echo $?", "", "negated\n1\n", None, 0),
    ("{ echo a; echo b; } > /tmp/f; cat /tmp/f", "", "a\nb\n", None, 0),
    ("(x=1; cd /data; exit 3); echo $? ${x:-unset} $(pwd)", "", "3 unset /\n", None, 0),
    ("(echo in-subshell; exit 1) || echo failed", "", "in-subshell\nfailed\n", None, 0),
    ("exit 7", "", "", None, 7),
    ("exit 300", "", "", None, 44),
    ("false; exit", "", "", None, 1),
    ("exit nope", "", "", "Illegal number", 2),
    # pipelines and background jobs
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
    # while, until, for, if, case, break, continue, functions
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
    ("local x=1", "", "", "not in a function", 1),
    ("return 3", "", "", "can only return", 1),
    # quoting and expansions
    ("echo '$HOME \"q\"'", "", '$HOME "q"\n', None, 0),
    ('echo "$HOME and \\$HOME"', "", "/root and $HOME\n", None, 0),
    ("echo a\\ b\\$c", "", "a b$c\n", None, 0),
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
    # assignments, export, unset, set -e, set -x
    ("X=1; echo $X", "", "1\n", None, 0),
    ("export Y=2; env | grep '^Y='", "", "Y=2\n", None, 0),
    ('Z=3 printenv Z; echo "[${Z-}]"', "", "3\n[]\n", None, 0),
    ('unset HOME; echo "[${HOME-unset}]"', "", "[unset]\n", None, 0),
    ("set -e; echo a; false; echo b", "", "a\n", None, 1),
    ("set -e; if false; then :; fi; false || true; ! true; echo survived", "", "survived\n", None, 0),
    ("set -e; f() { false; echo no; }; f; echo never", "", "", None, 1),
    ("set -x; echo hi", "", "hi\n", "+ echo hi", 0),
    # redirections and here-documents
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
    ("cat <<EOF\nhome=$HOME sum=$((1+1))\nEOF", "", "home=/root sum=2\n", None, 0),
    ("cat <<'EOF'\n$HOME $(x)\nEOF", "", "$HOME $(x)\n", None, 0),
    ("exec > /tmp/log; echo hidden; cat /tmp/log >&2", "", "", "hidden", 0),
    # tools
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
    ("cd /data; pwd; echo $PWD; cd ..; pwd; cd /nope", "", "/data\n/data\n/\n", "can't cd to /nope", 1),
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
    ("trap 'echo term' TERM; kill $$; echo after", "", "term\nafter\n", None, 0),
    ("echo a; kill -TERM 1; echo never", "", "a\n", None, 143),
    ("kill 999; echo $?", "", "0\n", None, 0),
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
    ("sh -c 'echo $0:$1; exit 4' me arg; echo $?", "", "me:arg\n4\n", None, 0),
    ("X=outer; export E=exp; sh -c 'echo [$X][$E]; X=inner'; echo $X", "", "[][exp]\nouter\n", None, 0),
    ("exec echo replaced; echo never", "", "replaced\n", None, 0),
    ("exec false", "", "", None, 1),
    ("/bin/echo a; /usr/bin/env | grep -c HOME", "", "a\n1\n", None, 0),
    ("frobnicate --x", "", "", "sh: frobnicate: not found", 127),
    ("if true; then echo x", "", "", "sh: syntax error", 2),
    ("echo a ;; echo b", "", "", "sh: syntax error", 2),
    ("cmd='echo evaluated'; eval \"$cmd\"; eval 'x=5'; echo $x", "", "evaluated\n5\n", None, 0),
    (". /data/lib.sh; echo $LIBVAR; libf a", "", "from-lib\nlibf a\n", None, 0),
    ("set -- a b c; shift; echo $# $1; shift 2; echo $#", "", "2 b\n0\n", None, 0),
    ("pgrep nginx; pgrep nope; echo $?", "", "2\n1\n", None, 0),
    # a few bash-isms that scripts in pods use
    (
        "command -v nope &>/dev/null || echo missing; ls /nope &>> /tmp/log; grep -c nope /tmp/log",
        "",
        "missing\n1\n",
        None,
        0,
    ),
    ('read a b <<< "x y"; echo $b$a', "", "yx\n", None, 0),
    ("function f { echo in-f $1; }; f x", "", "in-f x\n", None, 0),
    (
        "printf 'b\\na\\nb\\n' | sort -u; printf '10\\n9\\n' | sort -n; env | sort | head -n 1",
        "",
        "a\nb\n9\n10\nGREETING=hello world\n",
        None,
        0,
    ),
    # odds and ends
    ("trap 'echo int' INT; kill -INT $$; kill -9 $$; echo no", "", "int\n", None, 137),
    ("exec 3>/tmp/x; echo fd3 >&3; cat /tmp/x", "", "fd3\n", None, 0),
    ('x=$(cat <<EOF\ninside\nEOF\n); echo "[$x]"', "", "[inside]\n", None, 0),
    (
        "echo $((2**63)) $((7 & 3)) $((1 << 4)) $((!0)) $((010))",
        "",
        "-9223372036854775808 3 16 1 8\n",
        None,
        0,
    ),
    ("seq 512 | wc -l; seq 5 | tail -c 4", "", "512\n4\n5\n", None, 0),
    ("(trap 'echo sub-exit' EXIT; echo in); echo out", "", "in\nsub-exit\nout\n", None, 0),
]


@pytest.mark.parametrize(
    ("script", "stdin", "stdout", "stderr", "code"),
    TABLE,
    ids=[f"{i:03d}-{row[0][:40]}" for i, row in enumerate(TABLE)],
)
async def test_script(script: str, stdin: str, stdout: str, stderr: str | None, code: int) -> None:
    result = await Harness([stdin.encode()] if stdin else []).run(["sh", "-c", script])
    assert result.stdout.decode() == stdout
    if stderr is None:
        assert result.stderr == b""
    else:
        assert stderr in result.stderr.decode()
    assert result.code == code


def test_table_is_large() -> None:
    assert len(TABLE) >= 80


# --------------------------------------------------------------------------- SIGTERM


async def test_term_without_trap_ends_with_143() -> None:
    h = Harness(sleep=blocked_forever)
    task = asyncio.create_task(h.run(["sh", "-c", "echo start; sleep 100; echo never"]))
    await settle()
    assert bytes(h.stdout) == b"start\n" and not task.done()
    h.term.set()
    result = await task
    assert (result.stdout, result.code) == (b"start\n", 143)


async def test_term_trap_runs_at_the_interrupted_command_then_continues() -> None:
    h = Harness(sleep=blocked_forever)
    script = "trap 'echo got-term' TERM; echo start; sleep 100; echo after $?; sleep 5; echo end"
    task = asyncio.create_task(h.run(["sh", "-c", script]))
    await settle()
    h.term.set()
    await settle()
    assert bytes(h.stdout) == b"start\ngot-term\nafter 143\n" and not task.done()
    assert not h.term.is_set()  # taken: setting it again delivers another
    h.term.set()
    result = await task
    assert (result.stdout, result.code) == (b"start\ngot-term\nafter 143\ngot-term\nend\n", 0)


async def test_trap_exit_in_term_trap_with_background_sleep_and_wait() -> None:
    h = Harness(sleep=blocked_forever)
    task = asyncio.create_task(
        h.run(["sh", "-c", "trap 'echo bye; exit 0' TERM; echo hello; sleep 30 & wait"])
    )
    await settle()
    assert bytes(h.stdout) == b"hello\n" and not task.done()
    h.term.set()
    result = await task
    assert (result.stdout, result.stderr, result.code) == (b"hello\nbye\n", b"", 0)


async def test_term_ignored_by_empty_trap() -> None:
    release = asyncio.Event()

    async def sleep(seconds: float) -> None:
        await release.wait()

    h = Harness(sleep=sleep)
    task = asyncio.create_task(h.run(["sh", "-c", "trap '' TERM; sleep 10; echo finished"]))
    await settle()
    h.term.set()
    await settle()
    assert not task.done()
    release.set()
    result = await task
    assert (result.stdout, result.code) == (b"finished\n", 0)


async def test_term_interrupts_a_blocking_read() -> None:
    never = asyncio.Event()

    async def stdin() -> bytes:
        await never.wait()
        return b""

    h = Harness()
    h.io.stdin = stdin
    task = asyncio.create_task(
        h.run(["sh", "-c", "trap 'echo t' TERM; read x; echo read=$?; cat; echo cat=$?"])
    )
    await settle()
    h.term.set()
    await settle()
    assert bytes(h.stdout) == b"t\nread=143\n"
    h.term.set()
    result = await task
    assert result.stdout == b"t\nread=143\nt\ncat=143\n"


async def test_term_goes_to_the_shell_exec_started() -> None:
    h = Harness(sleep=blocked_forever)
    script = "trap 'echo outer' TERM; exec sh -c \"trap 'echo inner; exit 7' TERM; sleep 100\""
    task = asyncio.create_task(h.run(["sh", "-c", script]))
    await settle()
    h.term.set()
    result = await task
    assert (result.stdout, result.code) == (b"inner\n", 7)


async def test_term_without_trap_stops_a_pipeline() -> None:
    h = Harness(sleep=blocked_forever)
    task = asyncio.create_task(h.run(["sh", "-c", "sleep 100 | cat; echo never"]))
    await settle()
    h.term.set()
    assert (await task).code == 143


@pytest.mark.parametrize("argv", [["sleep", "3600"], ["sleep", "infinity"], ["tail", "-f", "/dev/null"]])
async def test_a_plain_blocking_command_takes_term(argv: list[str]) -> None:
    h = Harness(sleep=blocked_forever)
    task = asyncio.create_task(h.run(argv))
    await settle()
    h.term.set()
    assert (await task).code == 143


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


# --------------------------------------------------------------------------- here-documents


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


# --------------------------------------------------------------------------- files


async def test_files_persist_between_runs_sharing_a_memory_fs() -> None:
    fs = MemoryFs({"/etc/hostname": "pod\n"})
    fs.mkdir("/data")
    first = await Harness(fs=fs).run(
        ["sh", "-c", "echo written > /data/f; echo more >> /data/f; mkdir -p /data/d/e"]
    )
    assert first.code == 0
    second = await Harness(fs=fs).run(["sh", "-c", "cat /data/f; ls /data; test -d /data/d/e && echo dir"])
    assert second.stdout == b"written\nmore\nd\nf\ndir\n"
    assert fs.read("/data/f") == b"written\nmore\n"


def test_memory_fs_behaves_like_a_filesystem() -> None:
    fs = MemoryFs({"/a/b.txt": b"x", "/ro/c": "z"}, read_only=["/ro"])
    assert fs.is_dir("/a") and fs.exists("/a/b.txt") and fs.listdir("/") == ["a", "ro"]
    assert fs.read("/a/../a/b.txt") == b"x"
    with pytest.raises(FileNotFoundError):
        fs.read("/nope")
    with pytest.raises(IsADirectoryError):
        fs.read("/a")
    with pytest.raises(FileNotFoundError):
        fs.write("/missing/f", b"")
    with pytest.raises(NotADirectoryError):
        fs.listdir("/a/b.txt")
    with pytest.raises(FileExistsError):
        fs.mkdir("/a")
    with pytest.raises(OSError, match="not empty"):
        fs.remove("/a")
    with pytest.raises(PermissionError):
        fs.write("/ro/f", b"")
    with pytest.raises(PermissionError):
        fs.remove("/ro/c")
    fs.write("/a/b.txt", b"y", append=True)
    assert fs.read("/a/b.txt") == b"xy"
    fs.remove("/a/b.txt")
    fs.remove("/a")
    assert fs.listdir("/") == ["ro"]


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


# --------------------------------------------------------------------------- how a container runs


async def test_kubelet_idiom_prints_at_once_then_sleeps_without_spinning() -> None:
    calls: list[float] = []
    resume = asyncio.Event()

    async def sleep(seconds: float) -> None:
        calls.append(seconds)
        await resume.wait()

    h = Harness(sleep=sleep)
    task = asyncio.create_task(h.run(["sh", "-c", "echo hello-from-kubelet; while true; do sleep 1; done"]))
    await settle()
    assert bytes(h.stdout) == b"hello-from-kubelet\n"
    assert calls == [1.0] and not task.done()  # one sleeping coroutine, no busy loop
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_output_is_written_as_it_is_produced() -> None:
    seen_at_sleep: list[bytes] = []
    h = Harness()

    async def sleep(seconds: float) -> None:
        seen_at_sleep.append(bytes(h.stdout))

    h.io.sleep = sleep
    await h.run(["sh", "-c", "echo start; sleep 100; echo end"])
    assert seen_at_sleep == [b"start\n"]


async def test_twenty_thousand_iterations_complete() -> None:
    result = await Harness().run(["sh", "-c", "i=0; while [ $i -lt 20000 ]; do i=$((i+1)); done; echo $i"])
    assert (result.stdout, result.code) == (b"20000\n", 0)


async def test_endless_recursion_fails_with_a_message() -> None:
    result = await Harness().run(["sh", "-c", "f() { f; }; f; echo never"])
    assert result.code == 2 and b"nesting depth" in result.stderr and result.stdout == b""
    deep = await Harness().run(["sh", "-c", "f() { [ $1 -gt 0 ] && f $(($1 - 1)) || echo bottom; }; f 500"])
    assert deep.stdout == b"bottom\n"


@pytest.mark.parametrize(
    ("argv", "stdin", "stdout", "stderr", "code"),
    [
        (["echo", "hi"], b"", b"hi\n", b"", 0),
        (["/bin/echo", "a", "b"], b"", b"a b\n", b"", 0),
        (["sleep", "0"], b"", b"", b"", 0),
        (["cat"], b"typed\nlines\n", b"typed\nlines\n", b"", 0),
        (["/usr/bin/env", "-i", "A=1"], b"", b"A=1\n", b"", 0),
        (["nginx", "-g", "daemon off;"], b"", b"", b"sh: nginx: not found\n", 127),
        (["exit", "3"], b"", b"", b"", 3),
        (["/bin/sh", "-c", "echo $0 $1", "me", "x"], b"", b"me x\n", b"", 0),
        (["bash", "-ec", "false; echo no"], b"", b"", b"", 1),
        (["sh", "-c"], b"", b"", b"sh: -c requires an argument\n", 2),
        (
            ["sh"],
            b"echo one\nif true\nthen echo two\nfi\nread x\nfrom-stdin\necho $x\n",
            b"one\ntwo\nfrom-stdin\n",
            b"",
            0,
        ),
        (["sh", "-s"], b"exit 4\necho no\n", b"", b"", 4),
        ([], b"", b"", b"", 0),
    ],
)
async def test_container_commands(
    argv: list[str], stdin: bytes, stdout: bytes, stderr: bytes, code: int
) -> None:
    result = await Harness([stdin] if stdin else []).run(argv)
    assert (result.stdout, result.stderr, result.code) == (stdout, stderr, code)


async def test_run_script_and_pid() -> None:
    h = Harness()
    h.io.pid = 42
    assert await run_script("echo $$ $0; kill -TERM 1; echo still", h.io) == 0
    assert bytes(h.stdout) == b"42 sh\nstill\n"


async def test_extra_commands_get_argv_env_cwd_and_redirected_streams() -> None:
    seen: list[tuple[list[str], str | None, str, bytes]] = []

    async def lookup(argv: list[str], io: ShellIO) -> int:
        assert io.stdin is not None
        data = await io.stdin()
        seen.append((argv, io.env.get("SERVER"), io.cwd, data))
        await io.stdout(b"Address: 10.0.0.1\n")
        await io.stderr(b"warning\n")
        return 256 + 1  # a status is taken modulo 256

    async def whoami(argv: list[str], io: ShellIO) -> int:
        await io.stdout(b"app\n")
        return 0

    h = Harness()
    h.io.commands = {"nslookup": lookup, "whoami": whoami}
    script = (
        "cd /data; echo query | SERVER=dns /usr/bin/nslookup x 2>/dev/null | grep -c 10.0; echo $?; whoami"
    )
    result = await h.run(["sh", "-c", script])
    assert result.stdout == b"1\n0\napp\n" and result.stderr == b""
    assert seen == [(["/usr/bin/nslookup", "x"], "dns", "/data", b"query\n")]
    assert (await Harness().run(["sh", "-c", "command -v nslookup || echo none"])).stdout == b"none\n"


async def test_cancelling_the_run_stops_its_jobs() -> None:
    h = Harness(sleep=blocked_forever)
    before = len(asyncio.all_tasks())
    task = asyncio.create_task(h.run(["sh", "-c", "sleep 100 & sleep 200 & yes > /dev/null & wait"]))
    await settle()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await settle()
    assert len(asyncio.all_tasks()) == before


async def test_jobs_are_stopped_when_the_script_ends() -> None:
    h = Harness(sleep=blocked_forever)
    before = len(asyncio.all_tasks())
    result = await h.run(["sh", "-c", "sleep 100 & echo started $!"])
    await settle()
    assert result.stdout == b"started 2\n" and len(asyncio.all_tasks()) == before
