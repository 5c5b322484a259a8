"""The shell's awk and hexdump (backends/fake/shell/tools/awk.py, dump.py): the field-picking
programs pods run and the binary dump the ConfigMap spec reads, and a clear failure for the rest."""

from __future__ import annotations

from tests.fake.harness import Row, check_script, script_table

TABLE: list[Row] = [
    # The node e2e restart-count script (runtime.go): the count of a file's lines.
    ("f=/tmp/c; count=$(echo 'hello' >> $f ; wc -l $f | awk {'print $1'}); echo $count", "", "1\n", None, 0),
    ("printf ' a  b c\\n' | awk '{print $2}'", "", "b\n", None, 0),
    ("printf 'a b c\\nd e\\n' | awk '{ print $NF, $1 }'", "", "c a\ne d\n", None, 0),
    ("printf 'a b c\\n' | awk '{print $(NF-1) \"-\" $1; print NR, NF}'", "", "b-a\n1 3\n", None, 0),
    ("printf 'a b\\n' | awk '{print $0; print}'", "", "a b\na b\n", None, 0),
    ("awk -F: '{print $2}' /data/in.txt; printf 'x:y:z\\n' | awk -F: '{print $3}'", "", "\n\n\nz\n", None, 0),
    (
        "printf 'Name:\\tpod\\nCpus_allowed_list:\\t0-3\\n' | awk -F\":\\t*\" '/Cpus_allowed_list/ { print $2 }'",
        "",
        "0-3\n",
        None,
        0,
    ),
    ("awk '/t/' /data/in.txt", "", "two\nthree\n", None, 0),
    (
        'awk -v x=7 \'BEGIN { print "start" x } { print NR } END { print "end" }\' /data/in.txt',
        "",
        "start7\n1\n2\n3\nend\n",
        None,
        0,
    ),
    ("awk '{print $1}' /nope; echo $?", "", "2\n", "awk: cannot open /nope: No such file or directory", 0),
    ("awk '{ x = $1 }' /data/in.txt", "", "", "not supported by the fake runtime's awk", 2),
    ("awk '{ print $1 ' /data/in.txt", "", "", "missing '}'", 2),
]


@script_table(TABLE)
async def test_awk(script: str, stdin: str, stdout: str, stderr: str | None, code: int) -> None:
    await check_script(script, stdin, stdout, stderr, code)


HEXDUMP: list[Row] = [
    # The ConfigMap binaryData spec's line (configmap_volume.go).
    (
        "printf '\\336\\312\\376\\272\\320\\376\\377' > /tmp/b; hexdump -C /tmp/b",
        "",
        "00000000  de ca fe ba d0 fe ff                              |.......|\n00000007\n",
        None,
        0,
    ),
    (
        "printf '0123456789abcdefghij' | hexdump -C",
        "",
        "00000000  30 31 32 33 34 35 36 37  38 39 61 62 63 64 65 66  |0123456789abcdef|\n"
        "00000010  67 68 69 6a                                       |ghij|\n00000014\n",
        None,
        0,
    ),
    (
        "printf '%040d' 0 | hexdump -C",
        "",
        "00000000  30 30 30 30 30 30 30 30  30 30 30 30 30 30 30 30  |0000000000000000|\n*\n"
        "00000020  30 30 30 30 30 30 30 30                           |00000000|\n00000028\n",
        None,
        0,
    ),
    ("printf '%032d' 0 | hexdump -Cv | wc -l; hexdump -C /data/empty", "", "3\n", None, 0),
    ("hexdump /data/in.txt", "", "", "only -C", 1),
    ("hexdump -C /nope; echo $?", "", "1\n", "hexdump: /nope: No such file or directory", 0),
]


@script_table(HEXDUMP)
async def test_hexdump(script: str, stdin: str, stdout: str, stderr: str | None, code: int) -> None:
    await check_script(script, stdin, stdout, stderr, code)
