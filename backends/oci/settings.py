"""How an image store pulls: the node's registry configuration, as ``[images]`` and a handler's
options give it."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True, slots=True)
class PullSettings:
    # Registries spoken to over plain HTTP (host[:port]).
    insecure: frozenset[str] = frozenset({"127.0.0.1:5000", "localhost:5000"})
    # A directory of one directory per registry host, each with a hosts.toml (containerd's
    # layout): mirrors, CAs, client certificates, headers. "" = none.
    config_path: str = ""
    # A node-wide file of credentials by registry host, for pulls the kubelet sends none for.
    credentials_file: str = ""
    # Layers downloaded at once by one pull.
    max_concurrent_downloads: int = 3
    # Seconds a download may go without receiving a byte before it is cancelled (0 = never).
    progress_timeout: float = 300.0
    # Images reported pinned (never removed by the kubelet's GC): references or globs.
    pinned: tuple[str, ...] = ()
