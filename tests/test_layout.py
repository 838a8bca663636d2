"""The folder map of docs/architecture.md, kept true: which top-level package may import which. A
newcomer reads the map; this test fails the change that breaks it."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OURS = ("bench", "common", "decode_svc", "prefill_svc", "protos", "router", "tests")
# package -> the packages of ours it may import (itself always). The engine is a library: no services, no
# gRPC plumbing, no Redis; the services share common/ and the protos and never import one another; nothing
# that serves imports the benchmarks.
ALLOWED = {
    "common.engine": {"common.engine"},
    "common": {"common", "protos"},
    "prefill_svc": {"common", "protos", "prefill_svc"},
    "decode_svc": {"common", "protos", "decode_svc"},
    "router": {"common", "protos", "router"},
    "protos": {"protos"},
}
# The one place that starts every service in one process (for a laptop or a test) may import them all.
EXCEPTIONS = {"router/cluster.py": {"prefill_svc", "decode_svc"}}


def package_of(module: str) -> str:
    return "common.engine" if module.startswith("common.engine") else module.split(".")[0]


def imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {m for m in found if m.split(".")[0] in OURS}


def test_packages_import_only_what_the_map_allows():
    broken = []
    for path in sorted(ROOT.glob("**/*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith((".venv/", "tests/", "bench/")) or "/." in rel:
            continue
        own = package_of(rel.removesuffix(".py").replace("/", "."))
        allowed = ALLOWED[own] | EXCEPTIONS.get(rel, set())
        for module in imports(path):
            if package_of(module) not in allowed and module.split(".")[0] not in allowed:
                broken.append(f"{rel} imports {module}")
    assert not broken, "imports the folder map (docs/architecture.md) does not allow:\n" + "\n".join(broken)


def test_the_check_sees_a_forbidden_import(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("from router.generate import Router\nimport bench.engine\n")
    assert {"router.generate", "bench.engine"} <= imports(bad)
    assert package_of("common.engine.model") == "common.engine" and package_of("common.state") == "common"
