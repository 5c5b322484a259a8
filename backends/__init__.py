"""Runtime backends of cri-shim: docker, runv (VM per pod) and fake (in memory)."""
