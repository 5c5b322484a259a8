"""What cri-shim's own image stores share: the OCI distribution client (:mod:`.registry`), the
registry hosts configuration (:mod:`.hosts`, containerd's hosts.toml), credentials and auth
flows (:mod:`.auth`), HTTP with per-host TLS and progress timeouts (:mod:`.transport`), and the
settings a store pulls with (:mod:`.settings`)."""
