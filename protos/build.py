"""`python -m protos.build`: regenerate the gRPC stubs if a .proto changed; prints nothing when up to date.

The work is in protos.codegen, which `import protos` also runs; keeping it out of this module
lets `-m protos.build` run without runpy warning that the package already imported it.
"""
from __future__ import annotations

import sys

from protos.codegen import ensure_built


def main() -> int:
    try:
        ensure_built()
    except RuntimeError as exc:
        print(f"protos.build: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
