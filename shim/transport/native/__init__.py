from shim.transport.native.connection import (
    PREFACE,
    NativeServer,
    _percent,
    _timeout,
    encode_frame,
    listen_socket,
    literal_header,
    next_frame,
)

__all__ = [
    "PREFACE",
    "NativeServer",
    "_percent",
    "_timeout",
    "encode_frame",
    "listen_socket",
    "literal_header",
    "next_frame",
]
