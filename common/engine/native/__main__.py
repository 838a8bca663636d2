"""`python -m common.engine.native`: build the library for this CPU (or find its build) and print its path;
with --portable OUT, build it for any x86-64 with AVX2 into OUT (an image's, see HANDOFF_NATIVE_LIBRARY)."""
from __future__ import annotations

import argparse
from pathlib import Path

from common.engine.native import build


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m common.engine.native",
                                     description="Build decode's native kernels and print the library's path.")
    parser.add_argument("--portable", metavar="OUT", type=Path,
                        help="build for any x86-64 with AVX2 into OUT (for an image; see HANDOFF_NATIVE_LIBRARY)")
    args = parser.parse_args(argv)
    if args.portable:
        build.build_portable(args.portable)
        print(args.portable)
    else:
        print(build.build_host())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
