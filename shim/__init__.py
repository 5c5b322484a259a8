"""cri-shim: the CRI layer, backend-neutral."""

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
