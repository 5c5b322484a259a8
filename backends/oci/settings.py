"""How an image store pulls: the node's registry configuration, as ``[images]`` and a handler's
options give it."""

from __future__ import annotations

import dataclasses

from backends.oci.auth import CredentialsFile, TokenCache
from backends.oci.hosts import Hosts, load_hosts


@dataclasses.dataclass(frozen=True, slots=True)
class Registries:
    """What the settings' files say, read once (when the settings are made, so at the store's
    creation), and the bearer tokens the pulls with them obtained."""

    hosts: Hosts
    credentials: CredentialsFile
    tokens: TokenCache


@dataclasses.dataclass(frozen=True, slots=True)
class PullSettings:
    # Registries spoken to over plain HTTP (host[:port]) when no hosts.toml names their server.
    insecure: frozenset[str] = frozenset({"127.0.0.1:5000", "localhost:5000"})
    # A directory of one directory per registry host, each with a hosts.toml (containerd's
    # layout): mirrors, CAs, client certificates, headers. "" = none.
    config_path: str = ""
    # A node-wide file of credentials by registry host (docker's config.json), for pulls the
    # kubelet sends none for. "" = none.
    credentials_file: str = ""
    # Layers downloaded at once by one pull.
    max_concurrent_downloads: int = 3
    # Seconds a download may go without receiving a byte before it is cancelled (0 = never).
    progress_timeout: float = 300.0
    # Images reported pinned (never removed by the kubelet's GC): references or globs.
    pinned: tuple[str, ...] = ()
    # Parsed from config_path and credentials_file by __post_init__ (HostsConfigError,
    # CredentialsFileError: both ValueErrors naming the file and the key).
    registries: Registries = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.progress_timeout < 0:
            raise ValueError(f"progress_timeout must be 0 (off) or more seconds, not {self.progress_timeout}")
        if self.max_concurrent_downloads < 1:
            raise ValueError(
                f"max_concurrent_downloads must be 1 or more, not {self.max_concurrent_downloads}"
            )
        registries = Registries(
            load_hosts(self.config_path), CredentialsFile(self.credentials_file), TokenCache()
        )
        object.__setattr__(self, "registries", registries)
