"""The CRI logic, backend-neutral: services per RPC family over one shared state.

``servicer`` is the gRPC edge (the RPC table, conditions mapped to codes by
``errors``); ``runtime``, ``sandbox``, ``container`` and ``image`` answer the
RPCs over ``state.Shim``; ``store`` keeps and persists the records.
"""
