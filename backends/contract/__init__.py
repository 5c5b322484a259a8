"""What the CRI layer (``shim``) and the backends share, knowing neither of them.

Nothing here imports gRPC or ``shim``: the conditions a backend raises
(:mod:`backends.contract.errors`) are turned into status codes by the
servicer alone, through the one table in ``shim.errors``.
"""
