"""cri-shim: the CRI layer, backend-neutral."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("cri-shim")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0.1.0"
