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
