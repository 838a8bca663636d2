"""The gRPC contract: handoff.proto (public API) and internal.proto (router, workers, KV push).

Importing the package regenerates the stubs when a .proto is newer than them (a few stat
calls when they are up to date), so `python -m router` works on a fresh clone without make.
"""
from protos.codegen import ensure_built as _ensure_built

_ensure_built()
