"""What cri-shim's own image stores share: the OCI distribution client (:mod:`.registry`)."""
