"""The Node Resource Interface, runtime side: NRI plugins see and adjust what the shim runs.

- ``wire``: NRI's connection multiplexer and ttrpc, both ways over one unix stream;
- ``convert``: records → NRI's pod and container messages; NRI adjustments → CRI terms;
- ``service``: the socket, plugin registration and synchronisation, events in order.
"""
