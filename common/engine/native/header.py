"""The numbers the C library and Python must agree on, read from csrc/handoff_native.h: its integer
#defines (the packed layouts, the Q4 kernels' numbering, the shapes the kernels take). Python reads them
here and never restates one, so a layout changed in the header changes both sides."""
from __future__ import annotations

import re
from pathlib import Path

HEADER = Path(__file__).with_name("csrc") / "handoff_native.h"
_DEFINE = re.compile(r"^#define\s+([A-Z][A-Z0-9_]*)\s+(\d+)\b", re.MULTILINE)


def read_defines(path: Path = HEADER) -> dict[str, int]:
    """Every `#define NAME <integer>` of the header."""
    return {name: int(value) for name, value in _DEFINE.findall(path.read_text())}


DEFINES = read_defines()
