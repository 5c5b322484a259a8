"""The fake's agnhost (backends/fake/shell/tools/agnhost.py): the lines the node e2e specs match,
its exit codes, and the files it reads and writes."""

from __future__ import annotations

import asyncio
import os
import stat
from pathlib import Path

import pytest

from backends.fake.files import ContainerFiles, Mount, statfs_type
from backends.fake.shell import MemoryFs
from backends.fake.shell.fs import OVERLAYFS_MAGIC, TMPFS_MAGIC
from backends.fake.shell.tools.agnhost import go_file_mode
from tests.fake.harness import Harness, settle

NEW = "mount-tester new file\n"


def volume_fs() -> MemoryFs:
    fs = MemoryFs({"/etc/configmap-volume/data-1": "value-1\n", "/etc/hosts": "127.0.0.1\tlocalhost\n"})
    fs.mkdir("/test-volume")
    fs.chmod("/test-volume", 0o3777)  # setgid and sticky, as an fsGroup emptyDir's
    fs.chmod("/etc/configmap-volume/data-1", 0o400)
    return fs


@pytest.mark.parametrize(
    ("mode", "perm_only", "text"),
    [
        (stat.S_IFREG | 0o644, False, "-rw-r--r--"),
        (stat.S_IFDIR | 0o3777, False, "dgtrwxrwxrwx"),
        (stat.S_IFDIR | 0o3777, True, "-rwxrwxrwx"),
        (stat.S_IFREG | 0o4755, False, "urwxr-xr-x"),
        (stat.S_IFLNK | 0o777, False, "Lrwxrwxrwx"),
        (stat.S_IFCHR | 0o666, False, "Dcrw-rw-rw-"),
        (stat.S_IFIFO | 0o600, False, "prw-------"),
        (stat.S_IFREG | 0o400, True, "-r--------"),
    ],
    ids=["file", "setgid-sticky-dir", "dir-perm", "setuid", "symlink", "char-device", "fifo", "perm-0400"],
)
def test_file_modes_print_as_go_prints_them(mode: int, perm_only: bool, text: str) -> None:
    assert go_file_mode(mode, perm_only) == text


@pytest.mark.parametrize(
    ("args", "lines"),
    [
        (
            ["--fs_type=/test-volume", "--new_file_0644=/test-volume/f", "--file_perm=/test-volume/f"],
            [
                f'mount type of "/test-volume": {OVERLAYFS_MAGIC}',
                f'content of file "/test-volume/f": {NEW}',
                'perms of file "/test-volume/f": -rw-r--r--',
            ],
        ),
        (
            ["--new_file_0777=/test-volume/f", "--file_mode=/test-volume/f", "--file_owner=/test-volume/f"],
            [
                f'content of file "/test-volume/f": {NEW}',
                'mode of file "/test-volume/f": -rwxrwxrwx',
                'owner UID of "/test-volume/f": 0',
                'owner GID of "/test-volume/f": 0',
            ],
        ),
        (
            ["--new_file_0660", "/test-volume/f", "--file_perm", "/test-volume/f"],
            [f'content of file "/test-volume/f": {NEW}', 'perms of file "/test-volume/f": -rw-rw----'],
        ),
        (
            ["--file_mode=/test-volume", "--file_perm=/test-volume"],
            ['mode of file "/test-volume": dgtrwxrwxrwx', 'perms of file "/test-volume": -rwxrwxrwx'],
        ),
        (
            ["--file_mode=/etc/configmap-volume/data-1", "--file_content=/etc/configmap-volume/data-1"],
            [
                'mode of file "/etc/configmap-volume/data-1": -r--------',
                'content of file "/etc/configmap-volume/data-1": value-1\n',
            ],
        ),
        ([], []),
    ],
    ids=["0644-fs-type", "0777-mode-owner", "0660-spaced-flags", "volume-dir", "configmap-file", "nothing"],
)
async def test_mounttest_prints_agnhosts_lines(args: list[str], lines: list[str]) -> None:
    h = Harness(fs=volume_fs())
    result = await h.run(["/agnhost", "mounttest", *args])
    assert (result.code, result.stderr) == (0, b"")
    assert result.stdout.decode() == "".join(line + "\n" for line in lines)


async def test_mounttest_keeps_going_after_a_failure_and_exits_1() -> None:
    h = Harness(fs=volume_fs())
    result = await h.run(
        [
            "agnhost",
            "mounttest",
            "--file_perm=/nope",
            "--new_file_0644=/missing/dir/f",
            "--file_content=/etc/hosts",
        ]
    )
    assert result.code == 1
    assert result.stdout.decode() == (
        'error writing new file "/missing/dir/f": open /missing/dir/f: no such file or directory\n'
        'error from Stat("/nope"): stat /nope: no such file or directory\n'
        'content of file "/etc/hosts": 127.0.0.1\tlocalhost\n\n'
    )


async def test_mounttest_loop_reads_every_2s_until_the_new_file_text() -> None:
    fs = volume_fs()
    fs.write("/test-volume/f", b"old\n")
    h = Harness(fs=fs)
    sleeps = 0

    async def sleep(seconds: float) -> None:
        nonlocal sleeps
        assert seconds == 2.0
        sleeps += 1
        if sleeps == 2:
            fs.write("/test-volume/f", NEW.encode())
        await asyncio.sleep(0)

    h.io.sleep = sleep
    result = await h.run(["agnhost", "mounttest", "--file_content_in_loop=/test-volume/f", "--retry_time=60"])
    assert result.code == 0 and sleeps == 2
    unexpected = f'content of file "/test-volume/f": old\n\nUnexpected content. Expected: {NEW}. Retrying\n'
    assert result.stdout.decode() == unexpected * 2 + f'content of file "/test-volume/f": {NEW}\n'


@pytest.mark.parametrize(
    ("retry", "code", "reads"),
    [("--retry_time=6", 1, 3), ("--retry_time=0", 0, 0)],
    ids=["missing-file-fails-after-retries", "no-time-no-read"],
)
async def test_mounttest_loop_on_a_missing_file(retry: str, code: int, reads: int) -> None:
    h = Harness(fs=volume_fs())
    result = await h.run(["agnhost", "mounttest", "--file_content_in_loop=/gone", retry])
    assert result.code == code
    line = "Error reading file /gone: open /gone: no such file or directory, retrying\n"
    assert result.stdout.decode() == line * reads and h.slept == [2.0] * reads


async def test_mounttest_loop_without_break_reads_until_the_time_is_out() -> None:
    h = Harness(fs=volume_fs())
    args = ["--break_on_expected_content=false", "--retry_time=4", "--file_content_in_loop=/etc/hosts"]
    result = await h.run(["agnhost", "mounttest", *args])
    assert result.code == 0
    assert result.stdout.decode() == 'content of file "/etc/hosts": 127.0.0.1\tlocalhost\n\n' * 2


async def test_mounttest_on_a_read_only_volume_fails_the_write() -> None:
    fs = MemoryFs({"/etc/secret-volume/key": "s\n"}, read_only=["/etc/secret-volume"])
    result = await Harness(fs=fs).run(["agnhost", "mounttest", "--new_file_0644=/etc/secret-volume/new"])
    assert result.code == 1
    assert result.stdout == (
        b'error writing new file "/etc/secret-volume/new": open /etc/secret-volume/new: read-only file system\n'
    )


@pytest.mark.parametrize(
    ("argv", "stdout"),
    [
        (
            ["/agnhost", "entrypoint-tester", "override", "arguments"],
            "[/agnhost entrypoint-tester override arguments]\n",
        ),
        (["/agnhost-2", "entrypoint-tester"], "[/agnhost-2 entrypoint-tester]\n"),
    ],
    ids=["args", "agnhost-2"],
)
async def test_entrypoint_tester_prints_its_argv(argv: list[str], stdout: str) -> None:
    result = await Harness().run(argv)
    assert (result.code, result.stdout.decode(), result.stderr) == (0, stdout, b"")


@pytest.mark.parametrize(
    ("signal", "code", "name", "init"),
    [("TERM", 2, "terminated", True), ("INT", 1, "interrupt", True), ("TERM", 2, "terminated", False)],
    ids=["term-as-pid-1", "int", "term-not-init"],
)
async def test_pause_handles_term_and_int_even_as_pid_1(
    signal: str, code: int, name: str, init: bool
) -> None:
    h = Harness()
    h.io.init = init
    h.io.term_signal = signal
    h.io.env["TERMINATION_MESSAGE_PATH"] = "/tmp/msg"
    run = asyncio.ensure_future(h.run(["/agnhost", "pause"]))
    await settle()
    assert not run.done() and h.stdout == b"Paused\nSignals registered\n"
    h.term.set()
    result = await run
    message = f'exiting because of signal "{name}"\n'
    assert result.code == code and result.stdout.decode().endswith(message)
    assert h.fs.read("/tmp/msg").decode() == message


async def test_pause_ignores_another_signal_as_pid_1() -> None:
    h = Harness()
    h.io.init = True
    run = asyncio.ensure_future(h.run(["/agnhost", "pause"]))
    await settle()
    h.io.sent.append("HUP")  # as an exec's `kill -HUP 1` queues it
    h.term.set()
    await settle()
    assert not run.done()
    h.term.set()  # then the stop signal
    assert (await run).code == 2


async def test_etc_hosts_and_dns_lists() -> None:
    fs = volume_fs()
    fs.mkdir("/etc", parents=True)
    fs.write(
        "/etc/resolv.conf",
        b"nameserver 10.0.0.10\nnameserver 10.0.0.11\nsearch a.svc b.local\noptions ndots:5\n",
    )
    h = Harness(fs=fs)
    assert (await h.run(["/agnhost", "etc-hosts"])).stdout == b"127.0.0.1\tlocalhost\n\n"
    h.stdout.clear()
    assert (await h.run(["agnhost", "dns-suffix"])).stdout == b"a.svc,b.local\n"
    h.stdout.clear()
    assert (await h.run(["agnhost", "dns-server-list"])).stdout == b"10.0.0.10,10.0.0.11\n"


@pytest.mark.parametrize(
    ("argv", "stderr"),
    [
        (["agnhost", "nope"], 'Error: unknown command "nope" for "app"\n'),
        (["agnhost", "mounttest", "--bogus=1"], "Error: unknown flag: --bogus\n"),
        (
            ["agnhost", "mounttest", "--retry_time=soon"],
            'Error: invalid argument "soon" for "--retry_time" flag',
        ),
        (["agnhost", "mounttest", "--file_mode"], "Error: flag needs an argument: --file_mode\n"),
        (["agnhost", "mounttest", "--break_on_expected_content=maybe"], 'Error: invalid argument "maybe"'),
        (["agnhost", "porter"], "agnhost: porter: not simulated by the fake runtime's agnhost\n"),
    ],
    ids=["subcommand", "flag", "int", "missing-value", "bool", "not-simulated"],
)
async def test_bad_command_lines_fail_as_cobra_does(argv: list[str], stderr: str) -> None:
    result = await Harness().run(argv)
    assert result.code == 1 and result.stdout == b""
    assert result.stderr.decode().startswith(stderr)


async def test_a_subcommand_not_simulated_runs_until_stopped_as_a_containers_command() -> None:
    h = Harness()
    h.io.unknown_runs = True
    run = asyncio.ensure_future(h.run(["/agnhost", "grpc-health-checking"]))
    await settle()
    assert not run.done()
    h.term.set()
    assert (await run).code == 143


# ---------------------------------------------------------------------- a container's volumes on the host


def test_container_files_stat_chmod_and_fs_type_of_a_volume(tmp_path: Path) -> None:
    volume = tmp_path / "vol"
    volume.mkdir()
    os.chmod(volume, 0o2777)
    files = ContainerFiles({"/etc/hostname": b"pod\n"}, [Mount("/test-volume", str(volume))])
    files.write("/test-volume/f", b"x")
    files.chmod("/test-volume/f", 0o660)
    assert stat.S_IMODE(os.stat(volume / "f").st_mode) == 0o660  # the host file's mode
    st = files.stat("/test-volume")
    assert go_file_mode(st.mode) == "dgrwxrwxrwx" and (st.uid, st.gid) == (
        os.getuid(),
        os.stat(volume).st_gid,
    )
    assert files.fs_type("/test-volume") == statfs_type(str(tmp_path))
    assert files.fs_type("/etc") == OVERLAYFS_MAGIC  # the container's own files
    assert go_file_mode(files.stat("/etc").mode) == "drwxr-xr-x"
    with pytest.raises(FileNotFoundError):
        files.stat("/test-volume/nope")


def test_statfs_knows_a_tmpfs() -> None:
    mounts = Path("/proc/mounts").read_text().split("\n")
    tmpfs = [fields[1] for fields in (m.split() for m in mounts) if len(fields) > 2 and fields[2] == "tmpfs"]
    if not tmpfs:
        pytest.skip("no tmpfs mounted on this host")
    assert statfs_type(tmpfs[0]) == TMPFS_MAGIC
    with pytest.raises(FileNotFoundError):
        statfs_type("/nonexistent/path")
