"""Config: defaults, TOML parsing, errors that name section and key."""

import tomllib

import pytest

from shim.cli import main
from shim.config import DEFAULT_TOML, Config, ConfigError, default_config, parse


def test_default_toml_is_the_default_config() -> None:
    assert default_config() == Config()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[server]\nlisten = 3", "[server] listen: expected a string"),
        ("[server]\nnope = 1", "[server] unknown key 'nope'"),
        ("[bogus]\n", "unknown section [bogus]"),
        ("[logging]\nlevel = 'loud'", "[logging] level"),
        ("[handlers.x]\ntype = 'lxc'", "[handlers.x] type"),
        ("[server]\nsocket_mode = 'rwx'", "[server] socket_mode"),
        ("[streaming]\nport = -1", "[streaming] port"),
        ("[server]\ndefault_handler = 'gvisor'", "[handlers] no handler named 'gvisor'"),
        ("[server]\nevent_loop = 'trio'", "[server] event_loop: 'trio' is not uvloop or asyncio"),
        ("[cni]\nbin_dirs = '/usr/lib/cni'", "[cni] bin_dirs: expected a list of strings"),
        ("[cni]\nbin_dirs = []", "[cni] bin_dirs: needs at least one directory"),
        ("[cni]\nplugin_timeout = 0", "[cni] plugin_timeout: must be more than 0"),
        ("[cni]\nconfdir = '/x'", "[cni] unknown key 'confdir'"),
    ],
    ids=[
        "type",
        "unknown-key",
        "section",
        "level",
        "backend-type",
        "mode",
        "negative",
        "handler",
        "loop",
        "cni-bin-dirs",
        "cni-no-bin-dirs",
        "cni-timeout",
        "cni-key",
    ],
)
def test_errors_name_section_and_key(text: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse(tomllib.loads(text))
    assert message in str(info.value)


def test_handler_table_and_default() -> None:
    cfg = parse(
        tomllib.loads("[server]\ndefault_handler='docker'\n[handlers.fast]\ntype='fake'\nlatency={x=1}")
    )
    assert cfg.handlers["fast"].type == "fake" and cfg.handlers["fast"].options == {"latency": {"x": 1}}
    assert cfg.handlers["docker"].type == "docker"


def test_cli_config_default(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "default"]) == 0
    assert capsys.readouterr().out == DEFAULT_TOML


def test_cli_bad_config_file(tmp_path: object, capsys: pytest.CaptureFixture[str]) -> None:
    path = f"{tmp_path}/c.toml"
    with open(path, "w") as f:
        f.write("[server]\nlisten = [1]\n")
    assert main(["serve", "--config", path]) == 2
    assert "[server] listen" in capsys.readouterr().err


def test_cni_section() -> None:
    cfg = parse(tomllib.loads("[cni]\nconf_dir = '/n'\nbin_dirs = ['/a', '/b']\nplugin_timeout = 5"))
    assert (cfg.cni.conf_dir, cfg.cni.bin_dirs, cfg.cni.plugin_timeout) == ("/n", ("/a", "/b"), 5.0)
    assert cfg.cni.cache_dir == "" and Config().cni.bin_dirs == ("/opt/cni/bin", "/usr/lib/cni")


@pytest.mark.parametrize(
    ("argv", "level", "fmt"),
    [
        (["serve"], "info", "console"),
        (["serve", "--log-level", "debug", "--log-format", "json"], "debug", "json"),
        (["hollow", "--nodes", "1", "--log-level", "warning"], "warning", "console"),
        (["hollow", "--nodes", "1", "--log-format", "json"], "info", "json"),
    ],
    ids=["serve-defaults", "serve-both", "hollow-level", "hollow-format"],
)
def test_log_options_override_the_logging_section(argv: list[str], level: str, fmt: str) -> None:
    from shim import cli

    args = cli._parser().parse_args(argv)
    cfg = cli.build_config(args) if args.command == "serve" else cli.build_hollow(args).config
    assert (cfg.logging.level, cfg.logging.format) == (level, fmt)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[images]\nmax_concurrent_downloads = 0", "[images] max_concurrent_downloads: must be at least 1"),
        ("[images]\nmax_concurrent_downloads = 1.5", "[images] max_concurrent_downloads: expected a non-neg"),
        ("[images]\nimage_pull_progress_timeout = -1", "[images] image_pull_progress_timeout: expected a non"),
        ("[images]\nconfig_path = '/nonexistent/certs.d'", "[images] config_path: '/nonexistent/certs.d' is not"),
        ("[images]\ncredentials_file = '/nonexistent/auth.json'", "[images] credentials_file: '/nonexist"),
        ("[images]\npinned = 'busybox'", "[images] pinned: expected a list of strings"),
        ("[images]\npinned = ['Bad Name']", "[images] pinned: 'Bad Name' is not an image reference"),
        (
            "[images]\npull_no_progress_timeout = 1\nimage_pull_progress_timeout = 2",
            "[images] pull_no_progress_timeout is the old name of image_pull_progress_timeout",
        ),
        ("[images]\nconfigpath = '/x'", "[images] unknown key 'configpath'"),
    ],
    ids=["downloads-0", "downloads-float", "timeout", "config-path", "credentials", "pinned-type",
         "pinned-pattern", "both-timeouts", "images-key"],
)  # fmt: skip
def test_images_errors_name_the_key(text: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse(tomllib.loads(text))
    assert message in str(info.value)


def test_images_section_and_the_old_timeout_name(tmp_path: object) -> None:
    creds = f"{tmp_path}/auth.json"
    with open(creds, "w") as f:
        f.write("{}")
    cfg = parse(
        tomllib.loads(
            f"[images]\nconfig_path = '{tmp_path}'\ncredentials_file = '{creds}'\n"
            "max_concurrent_downloads = 5\nimage_pull_progress_timeout = 0\npinned = ['busybox:*']\n"
        )
    )
    assert cfg.images.handler_options() == {
        "pause_image": "registry.k8s.io/pause:3.10",
        "registry_config_path": str(tmp_path),
        "credentials_file": creds,
        "max_concurrent_downloads": 5,
        "image_pull_progress_timeout": 0.0,
        "pinned": ["busybox:*"],
    }
    assert cfg.notices == ()
    old = parse(tomllib.loads("[images]\npull_no_progress_timeout = 60"))
    assert old.images.image_pull_progress_timeout == 60.0
    assert len(old.notices) == 1 and "pull_no_progress_timeout is deprecated" in old.notices[0]


def test_the_default_hosts_directory_is_used_only_if_it_exists(monkeypatch: pytest.MonkeyPatch) -> None:
    from shim import config

    images = Config().images
    assert images.config_path == config.DEFAULT_CERTS_D
    monkeypatch.setattr(config.os.path, "isdir", lambda path: False)
    assert images.registry_config_path() == ""
    monkeypatch.setattr(config.os.path, "isdir", lambda path: path == config.DEFAULT_CERTS_D)
    assert images.registry_config_path() == config.DEFAULT_CERTS_D
    # Named in the file, it must exist.
    with pytest.raises(ConfigError, match="config_path"):
        parse(tomllib.loads(f"[images]\nconfig_path = '{config.DEFAULT_CERTS_D}/x'"))


def test_every_handler_gets_the_images_section_and_may_override_it(tmp_path: object) -> None:
    from backends.fake import FakeBackend
    from shim.server import Server

    text = (
        f"[server]\nstate_dir = '{tmp_path}'\n[images]\npinned = ['alpine:*']\n"
        "image_pull_progress_timeout = 30\n"
        "[handlers.fake]\n[handlers.own]\ntype = 'fake'\npinned = ['busybox:*']\n"
        "[handlers.old]\ntype = 'fake'\npull_no_progress_timeout = 7\n"
    )
    backends = Server(parse(tomllib.loads(text)))._build_backends()
    options = {name: b.options for name, b in backends.items() if isinstance(b, FakeBackend)}
    assert options["fake"]["pinned"] == ["alpine:*"] and options["own"]["pinned"] == ["busybox:*"]
    assert options["fake"]["image_pull_progress_timeout"] == 30.0
    assert options["old"]["image_pull_progress_timeout"] == 7  # its own value, by the old name
    assert "pull_no_progress_timeout" not in options["old"]
    bad = text.replace("['busybox:*']", "['Not A Ref']")
    from shim.server import ServerError

    with pytest.raises(ServerError, match=r"\[handlers.own\].*pinned: 'Not A Ref'"):
        Server(parse(tomllib.loads(bad)))._build_backends()
