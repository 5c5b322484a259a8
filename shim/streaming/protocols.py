"""Protocol names and what each version of the Kubernetes streaming protocols implies."""

from __future__ import annotations

import dataclasses
import json

from backends.contract import TerminalSize

# remotecommand over SPDY, most preferred first (client order wins in negotiation)
REMOTECOMMAND_V4 = "v4.channel.k8s.io"
REMOTECOMMAND_V3 = "v3.channel.k8s.io"
REMOTECOMMAND_V2 = "v2.channel.k8s.io"
REMOTECOMMAND_V1 = "channel.k8s.io"
SPDY_REMOTECOMMAND = (REMOTECOMMAND_V4, REMOTECOMMAND_V3, REMOTECOMMAND_V2, REMOTECOMMAND_V1)

PORTFORWARD_V1 = "portforward.k8s.io"
SPDY_PORTFORWARD = (PORTFORWARD_V1,)

SPDY_UPGRADE = "SPDY/3.1"
PROTOCOL_HEADER = "X-Stream-Protocol-Version"
ACCEPTED_PROTOCOLS_HEADER = "X-Accepted-Stream-Protocol-Versions"

# stream types (SPDY ``streamType`` header)
STREAM_ERROR = "error"
STREAM_STDIN = "stdin"
STREAM_STDOUT = "stdout"
STREAM_STDERR = "stderr"
STREAM_RESIZE = "resize"
STREAM_DATA = "data"

# WebSocket channels of remotecommand
CH_STDIN, CH_STDOUT, CH_STDERR, CH_ERROR, CH_RESIZE = 0, 1, 2, 3, 4
CH_CLOSE = 255  # v5: [255, channel] says the client closed that channel


@dataclasses.dataclass(frozen=True, slots=True)
class WsProtocol:
    name: str
    base64: bool
    status_json: bool  # v4+: exit status as a metav1.Status JSON
    close_signal: bool  # v5: channel 255 half-closes stdin


def _by_name(*protocols: WsProtocol) -> dict[str, WsProtocol]:
    return {p.name: p for p in protocols}


WS_REMOTECOMMAND = _by_name(
    WsProtocol("v5.channel.k8s.io", False, True, True),
    WsProtocol("v4.channel.k8s.io", False, True, False),
    WsProtocol("v4.base64.channel.k8s.io", True, True, False),
    WsProtocol("channel.k8s.io", False, False, False),
    WsProtocol("base64.channel.k8s.io", True, False, False),
)
WS_LEGACY = WsProtocol("", False, False, False)  # a client that offered no subprotocol

# port-forward over WebSocket, channel style: per port a data and an error channel
WS_PORTFORWARD = _by_name(
    WsProtocol("v4.channel.k8s.io", False, False, False),
    WsProtocol("portforward.k8s.io", False, False, False),
    WsProtocol("v4.base64.channel.k8s.io", True, False, False),
)
# port-forward as SPDY tunnelled through binary WebSocket messages (client-go's
# SPDYOverWebsocket dialer, used by crictl and critest with the websocket transport)
WS_SPDY_TUNNEL = "SPDY/3.1+" + PORTFORWARD_V1


def negotiate(offered: list[str], supported: tuple[str, ...] | list[str]) -> str | None:
    """The first protocol the client offered that we support (the client's order wins)."""
    for name in offered:
        if name in supported:
            return name
    return None


def spdy_status(protocol: str) -> bool:
    """Whether this SPDY remotecommand version reports exit status as Status JSON."""
    return protocol == REMOTECOMMAND_V4


def spdy_has_resize(protocol: str) -> bool:
    return protocol in (REMOTECOMMAND_V4, REMOTECOMMAND_V3)


# --------------------------------------------------------------------------- payloads


def status_json(exit_code: int, error: str | None, cmd_desc: str = "") -> bytes:
    """The metav1.Status the v4+ protocols put on the error stream."""
    if error is not None:
        status: dict[str, object] = {
            "metadata": {},
            "status": "Failure",
            "message": f"Internal error occurred: {error}",
            "reason": "InternalError",
            "details": {"causes": [{"message": error}]},
            "code": 500,
        }
    elif exit_code == 0:
        status = {"metadata": {}, "status": "Success"}
    else:
        status = {
            "metadata": {},
            "status": "Failure",
            "message": f"command terminated with non-zero exit code: {exit_message(exit_code, cmd_desc)}",
            "reason": "NonZeroExitCode",
            "details": {"causes": [{"reason": "ExitCode", "message": str(exit_code)}]},
        }
    return json.dumps(status, separators=(",", ":")).encode()


def status_text(exit_code: int, error: str | None, cmd_desc: str = "") -> bytes:
    """What v1-v3 put on the error stream: nothing on success, else a message."""
    if error is not None:
        return error.encode()
    if exit_code == 0:
        return b""
    return f"command terminated with non-zero exit code: {exit_message(exit_code, cmd_desc)}".encode()


def exit_message(exit_code: int, cmd_desc: str) -> str:
    return f"command {cmd_desc} exited with {exit_code}" if cmd_desc else f"exit code {exit_code}"


class ResizeDecoder:
    """Terminal sizes from a stream of concatenated JSON objects {"Width":..,"Height":..}."""

    MAX_BUFFER = 4096

    def __init__(self) -> None:
        self._buf = ""
        self._json = json.JSONDecoder()

    def feed(self, data: bytes) -> list[TerminalSize]:
        self._buf += data.decode("utf-8", errors="replace")
        sizes: list[TerminalSize] = []
        while True:
            text = self._buf.lstrip()
            if not text:
                self._buf = ""
                return sizes
            try:
                obj, end = self._json.raw_decode(text)
            except json.JSONDecodeError:
                if len(text) > self.MAX_BUFFER:
                    self._buf = ""  # garbage, not a partial object: drop it
                else:
                    self._buf = text
                return sizes
            self._buf = text[end:]
            if isinstance(obj, dict):
                width, height = obj.get("Width", 0), obj.get("Height", 0)
                if (
                    isinstance(width, int)
                    and isinstance(height, int)
                    and 0 <= width < 65536
                    and 0 <= height < 65536
                ):
                    sizes.append(TerminalSize(width=width, height=height))
