# Imported before any test module, and so before grpc: shim turns gRPC's fork support off.
import shim  # noqa: F401
