"""Compile the .proto files into Python stubs with grpcio-tools, only when they are stale.

The stubs (`*_pb2.py`, `*_pb2.pyi`, `*_pb2_grpc.py`) are generated, never committed:
`python -m protos.build` (run by the Makefile) and `import protos` both call ensure_built().
The proto files are compiled with the repository root as the include path, so the stubs
import each other as `from protos import handoff_pb2`.
"""
from __future__ import annotations

import importlib.resources
import os
import shutil
import sys
import tempfile
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_NAMES = ("handoff", "internal")
_OUTPUT_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def proto_paths(root: Path = ROOT) -> list[Path]:
    """The .proto sources under root/protos."""
    return [root / "protos" / f"{name}.proto" for name in PROTO_NAMES]


def output_paths(root: Path = ROOT) -> list[Path]:
    """Every file the build writes under root/protos."""
    return [root / "protos" / f"{name}{suffix}" for name in PROTO_NAMES for suffix in _OUTPUT_SUFFIXES]


def is_stale(root: Path = ROOT) -> bool:
    """True if a stub is missing or older than a .proto file (or than this generator)."""
    try:
        oldest_output_ns = min(p.stat().st_mtime_ns for p in output_paths(root))
    except FileNotFoundError:
        return True
    return _newest_input_ns(root) > oldest_output_ns


def _newest_input_ns(root: Path) -> int:
    return max(p.stat().st_mtime_ns for p in [*proto_paths(root), Path(__file__)])


def build(root: Path = ROOT) -> None:
    """Compile every .proto under root/protos, replacing the stubs atomically.

    protoc writes into a private temporary folder and each file is then moved into place with
    os.replace, so a process importing the stubs while another one builds never reads a
    half-written file; two builds racing just write the same content twice.
    """
    from grpc_tools import protoc  # only needed when something is stale

    out_dir = root / "protos"
    tmp_dir = Path(tempfile.mkdtemp(prefix=".build-", dir=out_dir))  # same filesystem: os.replace is atomic
    try:
        with importlib.resources.as_file(importlib.resources.files("grpc_tools") / "_proto") as wkt_dir:
            args = ["grpc_tools.protoc", f"-I{root}", f"-I{wkt_dir}",
                    f"--python_out={tmp_dir}", f"--pyi_out={tmp_dir}", f"--grpc_python_out={tmp_dir}",
                    *(str(p) for p in proto_paths(root))]
            exit_code = protoc.main(args)
        if exit_code != 0:
            raise RuntimeError(f"protoc failed (exit code {exit_code}) compiling "
                               f"{', '.join(p.name for p in proto_paths(root))}; its errors are printed above")
        newest_input_ns = _newest_input_ns(root)
        for dst in output_paths(root):
            src = tmp_dir / "protos" / dst.name
            if src.stat().st_mtime_ns < newest_input_ns:
                # A .proto dated in the future (clock skew, an unpacked archive) would otherwise
                # make every later import rebuild again.
                os.utime(src, ns=(newest_input_ns, newest_input_ns))
            os.replace(src, dst)
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)


def ensure_built(root: Path = ROOT) -> bool:
    """Rebuild the stubs if they are stale; return True if it rebuilt. Silent when up to date."""
    if not is_stale(root):
        return False
    try:
        build(root)
    except (ImportError, OSError) as exc:
        # A read-only install or one without grpcio-tools can still run on stubs built earlier.
        if all(p.exists() for p in output_paths(root)):
            warnings.warn(f"protos: the stubs are older than the .proto files but could not be rebuilt "
                          f"({exc}); using the existing ones", RuntimeWarning, stacklevel=2)
            return False
        raise
    print(f"protos: compiled {', '.join(p.name for p in proto_paths(root))} into {root / 'protos'}",
          file=sys.stderr)
    return True
