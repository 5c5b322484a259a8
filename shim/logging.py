"""structlog set-up: console or JSON lines on stderr, filtered by level."""

from __future__ import annotations

import logging
import sys

import structlog

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


_debug = True  # structlog's default configuration prints every level


def debug_enabled() -> bool:
    """Whether debug lines are printed (callers skip building lines that would not be)."""
    return _debug


def configure(level: str = "info", fmt: str = "console") -> None:
    global _debug
    _debug = _LEVELS[level] <= logging.DEBUG
    renderer: structlog.types.Processor
    if fmt == "json":
        renderer = structlog.processors.JSONRenderer()
    else:
        renderer = structlog.dev.ConsoleRenderer(colors=False)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        # A filtering logger makes a disabled debug call nearly free: List* and
        # Status are polled every second by every kubelet.
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS[level]),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    logging.basicConfig(level=_LEVELS[level], stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
