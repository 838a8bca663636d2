"""python -m bench.zoo: build the small architectures (--build), report on them (--check), build benchmark
shapes (--big SHAPE --qtypes Q4_K_M,Q8_0)."""
from __future__ import annotations

import argparse
import sys

from common import cli
from bench.zoo.big import BIG_SHAPES, big_all
from bench.zoo.check import check
from bench.zoo.small import build
from bench.zoo.specs import ARCHS


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.zoo", description=__doc__)
    cli.add_switch(p, "--build", "build the small architectures")
    cli.add_switch(p, "--check", "build the small architectures and report on their files")
    p.add_argument("--arch", action="append", choices=ARCHS, help="only this architecture (repeatable)")
    p.add_argument("--big", action="append", choices=tuple(BIG_SHAPES), help="build this benchmark shape (repeatable)")
    p.add_argument("--qtypes", default="Q4_K_M,Q8_0", help="the benchmark shapes' types, comma-separated")
    cli.add_switch(p, "--keep-f16", "keep the benchmark shapes' F16 files")
    args = p.parse_args(argv)
    if not (args.build or args.check or args.big):
        p.error("nothing to do: give --build, --check or --big SHAPE")
    archs = tuple(args.arch or ARCHS)
    if args.build:
        for arch in archs:
            print(arch, build(arch).root, flush=True)
    rc = 0
    if args.check:
        problems = check(archs)
        print(f"{problems} problem(s)")
        rc = 1 if problems else 0
    for shape in args.big or []:
        for q, path in big_all(shape, args.qtypes.split(","), keep_f16=args.keep_f16).items():
            print(shape, q, path, f"{path.stat().st_size / 1e6:.0f} MB", flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
