"""cri-shim: the CRI layer, backend-neutral.

Its parts, from the process down:

- the process, the modules of this package itself: ``cli`` (the ``cri-shim``
  command), ``config``, ``logging``, ``server`` (one node's startup → serve →
  shutdown), ``hollow`` (many fake nodes in one process), ``prometheus``
  (the /metrics endpoint);
- ``transport``: how the CRI socket is served, by grpcio's server or the native one;
- ``cri``: the CRI logic, from the servicer down to the store;
- ``streaming`` (exec, attach, port-forward) and ``nri`` (NRI plugins): units
  that the CRI logic and the server use.

Of the process, ``transport`` and ``cri`` use only ``config`` and ``logging``
(tests/rules/test_import_contract.py).
"""

import os
from importlib.metadata import PackageNotFoundError, version

# gRPC's fork support must be off before grpc is first imported. Under uvloop
# every subprocess (runc, ip, iptables, the share helper) is started with
# fork(), which runs gRPC's fork handlers: some children then died of SIGSEGV
# before exec, with no output, and every other fork logged "skipping fork()
# handlers". The shim never uses gRPC in a child, so the handlers serve nothing.
os.environ["GRPC_ENABLE_FORK_SUPPORT"] = "false"

try:
    __version__ = version("cri-shim")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0.1.0"
