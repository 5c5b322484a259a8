"""Host mechanics that more than one backend needs (directory usage, ...)."""
