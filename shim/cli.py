"""The `cri-shim` command: serve, version, config default."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import sys
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

from shim import __version__
from shim.config import DEFAULT_TOML, Config, ConfigError, load

if TYPE_CHECKING:
    from shim.hollow import Hollow


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="cri-shim", description="A Kubernetes CRI v1 shim.")
    sub = p.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve the CRI on a unix socket")
    serve.add_argument("--config", help="TOML configuration file (see `cri-shim config default`)")
    serve.add_argument("--listen", help="unix:///path/to.sock or fd:// (systemd socket activation)")
    serve.add_argument("--state-dir", help="where records are persisted")
    serve.add_argument(
        "--default-handler", help="runtime handler for requests that name none (fake, docker, runv)"
    )
    serve.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    serve.add_argument("--log-format", choices=["json", "console"])
    serve.add_argument("--metrics-listen", help="host:port of the Prometheus /metrics endpoint")
    serve.add_argument(
        "--transport",
        choices=["native", "grpcio"],
        help="how the CRI socket is served ([server] transport; default: native)",
    )
    hollow = sub.add_parser(
        "hollow",
        help="serve N isolated fake nodes from one process, one socket each (as kubemark's hollow nodes)",
    )
    hollow.add_argument("--nodes", type=int, required=True, help="how many nodes")
    hollow.add_argument(
        "--socket-template",
        default="/run/cri-shim/node-{i}.sock",
        help="node i's CRI socket, {i} replaced by the node's index (default: %(default)s)",
    )
    hollow.add_argument(
        "--state-root",
        default="/var/lib/cri-shim/hollow",
        help="node i's records go to STATE_ROOT/node-{i} (default: %(default)s)",
    )
    hollow.add_argument(
        "--pod-cidr-template",
        default="10.0.0.0/8",
        help="node i's pod IP range: a CIDR with {i} (10.{i}.0.0/16) or one CIDR split into "
        "N equal ranges (default: %(default)s)",
    )
    hollow.add_argument(
        "--transport",
        choices=["native", "grpcio"],
        default="native",
        help="how each node's socket is served ([server] transport; default: %(default)s)",
    )
    hollow.add_argument("--config", help="TOML configuration file; only fake handlers")
    hollow.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    hollow.add_argument("--log-format", choices=["json", "console"])
    sub.add_parser("version", help="print the version")
    cfg = sub.add_parser("config", help="configuration helpers")
    cfg_sub = cfg.add_subparsers(dest="config_command", required=True)
    cfg_sub.add_parser("default", help="print the full default configuration with comments")
    return p


def build_config(args: argparse.Namespace) -> Config:
    cfg = load(args.config)
    server = cfg.server
    if args.listen:
        server = dataclasses.replace(server, listen=args.listen)
    if args.state_dir:
        server = dataclasses.replace(server, state_dir=args.state_dir)
    if args.metrics_listen:
        server = dataclasses.replace(server, metrics_listen=args.metrics_listen)
    if args.default_handler:
        server = dataclasses.replace(server, default_handler=args.default_handler)
    if getattr(args, "transport", None):
        server = dataclasses.replace(server, transport=args.transport)
    cfg = dataclasses.replace(with_log_options(cfg, args), server=server)
    return cfg.with_handler(server.default_handler)


def with_log_options(cfg: Config, args: argparse.Namespace) -> Config:
    """``cfg`` with --log-level and --log-format, where given, over its [logging] section
    (``serve`` and ``hollow`` both take them)."""
    logging_ = cfg.logging
    if args.log_level:
        logging_ = dataclasses.replace(logging_, level=args.log_level)
    if args.log_format:
        logging_ = dataclasses.replace(logging_, format=args.log_format)
    return dataclasses.replace(cfg, logging=logging_)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "version":
        print(f"cri-shim {__version__} (CRI runtime API v1)")
        return 0
    if args.command == "config":
        sys.stdout.write(DEFAULT_TOML)
        return 0
    if args.command == "hollow":
        return _hollow(args)
    try:
        cfg = build_config(args)
    except ConfigError as exc:
        print(f"cri-shim: configuration error: {exc}", file=sys.stderr)
        return 2
    from shim.logging import configure
    from shim.server import Server, ServerError

    configure(cfg.logging.level, cfg.logging.format)
    return run_command(_serve(Server(cfg)), cfg.server.event_loop, ServerError, "cri-shim")


def build_hollow(args: argparse.Namespace) -> Hollow:
    """The ``cri-shim hollow`` arguments → the nodes (ConfigError or HollowError if they are wrong)."""
    from shim.hollow import Hollow, plan

    cfg = with_log_options(load(args.config), args)
    server = dataclasses.replace(cfg.server, transport=getattr(args, "transport", None) or "native")
    cfg = dataclasses.replace(cfg, server=server)
    nodes = plan(args.nodes, args.socket_template, args.state_root, args.pod_cidr_template)
    return Hollow(cfg, nodes)


def _hollow(args: argparse.Namespace) -> int:
    """``cri-shim hollow``: N fake nodes from one process (shim/hollow.py)."""
    from shim import hollow as nodes

    try:
        hollow = build_hollow(args)
    except ConfigError as exc:
        print(f"cri-shim: configuration error: {exc}", file=sys.stderr)
        return 2
    except nodes.HollowError as exc:
        print(f"cri-shim hollow: {exc}", file=sys.stderr)
        return 2
    from shim.logging import configure

    configure(hollow.config.logging.level, hollow.config.logging.format)
    if hollow.config.server.metrics_listen:
        nodes.log.warning("hollow.metrics_ignored", metrics_listen=hollow.config.server.metrics_listen)
    return run_command(
        hollow.run_until_signalled(), hollow.config.server.event_loop, nodes.HollowError, "cri-shim hollow"
    )


def run_command(main: Coroutine[Any, Any, None], event_loop: str, failure: type[Exception], prog: str) -> int:
    """Run ``main`` to its end; the exit status: 0, or 1 once stderr says which ``failure``
    stopped it, or 130 on an interrupt (``serve`` and ``hollow`` alike)."""
    try:
        _run(main, event_loop)
    except failure as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


def _run(main: Coroutine[Any, Any, None], event_loop: str) -> None:
    """Run the server on uvloop (less time per RPC) when asked for and installed, else asyncio."""
    if event_loop == "uvloop":
        try:
            import uvloop
        except ImportError:
            print("cri-shim: uvloop is not installed; running on asyncio's event loop", file=sys.stderr)
        else:
            uvloop.run(main)
            return
    asyncio.run(main)


async def _serve(server: object) -> None:
    from shim.server import Server

    assert isinstance(server, Server)
    metrics_listen = server.config.server.metrics_listen
    if metrics_listen:
        from shim import prometheus  # type: ignore[attr-defined, unused-ignore]

        prometheus.start(metrics_listen, server)
    await server.run_until_signalled()


if __name__ == "__main__":
    sys.exit(main())
