"""Transports: how the CRI servicer is served on the socket.

``grpcio`` is grpcio's aio server; ``native`` is HTTP/2 and gRPC on the
event loop itself. ``[server] transport`` picks one; both serve the same
:class:`shim.cri.servicer.CriServicer`.
"""
