"""llama.cpp's own model tools, built once and cached outside the repository: its HF -> GGUF converter
(convert_hf_to_gguf.py) and its quantizer (llama-quantize). The model zoo (bench/zoo) makes its GGUF files
with them, so that the files are exactly what llama.cpp's users download.

    <root>/src/                 llama.cpp's source: the vendor/llama.cpp of the llama-cpp-python sdist
                                (the same version `make bench-peers` compiles); a symlink is fine
    <root>/bin/llama-quantize   static and portable (AVX2, no AVX-512, GGML_NATIVE=OFF), so a cached
                                binary runs on every host of the fleet; .json beside it: how it was built

root is $HANDOFF_LLAMA_CPP_DIR or ~/.cache/handoff/llama.cpp. `make llama-tools` (`python -m
bench.llama_tools`) builds both; `missing()` says what is not there, without building anything.
"""
from __future__ import annotations

import fcntl
import json
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
SDIST = f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}"
# GGML_NATIVE=OFF turns on SSE4.2 / AVX / AVX2 / BMI2 / FMA / F16C and leaves every AVX-512 option off
# (ggml/CMakeLists.txt); static, so bin/ needs nothing from the build folder.
CMAKE_FLAGS = [
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=OFF",
    "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON", "-DGGML_BMI2=ON",
    "-DGGML_AVX512=OFF", "-DGGML_AVX512_VBMI=OFF", "-DGGML_AVX512_VNNI=OFF",
    "-DGGML_AVX512_BF16=OFF", "-DGGML_AVX_VNNI=OFF",
    "-DGGML_BACKEND_DL=OFF", "-DGGML_CPU_ALL_VARIANTS=OFF",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=OFF",
    "-DLLAMA_BUILD_APP=OFF", "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_UI=OFF",
]
HOW_TO_GET = "run `make llama-tools`"
PRE_HASHES_ENV = "HANDOFF_CONVERT_PRE_HASHES"


class ToolError(RuntimeError):
    """A tool could not be obtained or failed; the message says what to run."""


def cache_root() -> Path:
    return Path(os.environ.get("HANDOFF_LLAMA_CPP_DIR") or "~/.cache/handoff/llama.cpp").expanduser()


def source_dir() -> Path:
    return cache_root() / "src"


def quantize_bin() -> Path:
    return cache_root() / "bin" / "llama-quantize"


def missing() -> str | None:
    """What of the tools is not built (None: both are there). Builds nothing."""
    if not (source_dir() / "convert_hf_to_gguf.py").is_file():
        return f"no llama.cpp source at {source_dir()}"
    if not os.access(quantize_bin(), os.X_OK):
        return f"no {quantize_bin()}"
    return None


def _log(msg: str) -> None:
    print(f"[llama_tools] {msg}", file=sys.stderr, flush=True)


def ensure_src() -> Path:
    """<root>/src; downloads the sdist and extracts its vendor/llama.cpp there when absent."""
    src = source_dir()
    if (src / "convert_hf_to_gguf.py").is_file() and (src / "gguf-py" / "gguf").is_dir():
        return src
    if src.is_symlink() or src.exists():
        raise ToolError(f"{src} exists but is not a llama.cpp tree; remove it and {HOW_TO_GET}")
    src.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=src.parent, prefix=".dl-") as tmp:
        tmp = Path(tmp)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", SDIST, "-d", str(tmp)]
        _log("running " + " ".join(cmd[2:]))
        r = subprocess.run(cmd, capture_output=True, text=True)
        tars = list(tmp.glob("llama_cpp_python-*.tar.gz"))
        if r.returncode != 0 or not tars:
            raise ToolError(f"pip download of {SDIST} failed (rc={r.returncode}):\n{r.stderr[-2000:]}")
        prefix = f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}/vendor/llama.cpp/"
        with tarfile.open(tars[0]) as tf:
            members = [m for m in tf.getmembers() if m.name.startswith(prefix) and len(m.name) > len(prefix)]
            for m in members:
                m.name = m.name[len(prefix):]
            if not members:
                raise ToolError(f"{tars[0]} has no {prefix}")
            tf.extractall(tmp / "llama.cpp", members=members, filter="data")
        os.replace(tmp / "llama.cpp", src)
    _log(f"llama.cpp source at {src}")
    return src


def ensure_quantize() -> Path:
    """<root>/bin/llama-quantize; builds it when absent, one builder at a time (the others wait for it)."""
    exe = quantize_bin()
    if os.access(exe, os.X_OK):
        return exe
    exe.parent.mkdir(parents=True, exist_ok=True)
    with open(cache_root() / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if os.access(exe, os.X_OK):
            return exe
        return _build_quantize(exe)


def _build_quantize(exe: Path) -> Path:
    src = ensure_src()
    for tool in ("cmake", "c++"):
        if shutil.which(tool) is None:
            raise ToolError(f"{tool} not found: install it (apt-get install cmake g++), then {HOW_TO_GET}")
    build = cache_root() / "build"
    jobs = str(os.cpu_count() or 2)
    # Configured from the resolved path: the sdist's vendor/llama.cpp/.git points at ../../.git/...;
    # through a symlinked src/ ninja normalises that lexically to a path that does not exist and
    # re-runs cmake forever ("build.ninja still dirty after 100 tries").
    steps = [["cmake", "-S", str(src.resolve()), "-B", str(build), *(["-G", "Ninja"] if shutil.which("ninja") else []),
              *CMAKE_FLAGS],
             ["cmake", "--build", str(build), "--target", "llama-quantize", "-j", jobs]]
    log_path = cache_root() / "build.log"
    t0 = time.time()
    with open(log_path, "w") as log:
        for cmd in steps:
            _log("running " + " ".join(cmd))
            log.write("$ " + " ".join(cmd) + "\n")
            log.flush()
            if subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT).returncode != 0:
                raise ToolError(f"building llama-quantize failed at: {' '.join(cmd)}; see {log_path}")
    built = build / "bin" / "llama-quantize"
    tmp = exe.with_name(f"{exe.name}.tmp{os.getpid()}")
    shutil.copy2(built, tmp)
    os.replace(tmp, exe)
    compiler = subprocess.run(["c++", "--version"], capture_output=True, text=True).stdout.splitlines()[:1]
    exe.with_suffix(".json").write_text(json.dumps({
        "sdist": SDIST, "cmake_flags": CMAKE_FLAGS, "compiler": compiler, "jobs": jobs,
        "build_seconds": round(time.time() - t0, 1), "host": platform.node(), "built_at": time.ctime()}, indent=1))
    _log(f"built {exe}")
    return exe


def quantize(src_gguf: Path, dst_gguf: Path, qtype: str) -> Path:
    """llama-quantize src_gguf (F32/F16) to dst_gguf in qtype (its own names: Q8_0, Q4_K_M, ...); atomic."""
    exe = ensure_quantize()
    tmp = dst_gguf.with_name(dst_gguf.name + ".part")
    cmd = [str(exe), str(src_gguf), str(tmp), qtype, str(os.cpu_count() or 2)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0 or not tmp.is_file():
        tmp.unlink(missing_ok=True)
        raise ToolError(f"llama-quantize failed (rc={r.returncode}): {' '.join(cmd)}\n{(r.stdout + r.stderr)[-3000:]}")
    os.replace(tmp, dst_gguf)
    return dst_gguf


def convert(hf_dir: Path, out: Path, outtype: str = "f32", extra_args: tuple[str, ...] = (),
            pre_hashes: dict[str, str] | None = None) -> Path:
    """llama.cpp's convert_hf_to_gguf.py on an HF folder, in a subprocess with the source's own gguf-py first
    on the path (nothing under src/ is edited); atomic. pre_hashes: {pre-tokenizer hash: name} the converter's
    table lacks (what its convert_hf_to_gguf_update.py would add for a new model)."""
    src = ensure_src()
    tmp = out.with_name(out.name + ".part")
    cmd = [sys.executable, "-m", "bench.llama_tools", "--run-converter", str(src), str(hf_dir),
           "--outfile", str(tmp), "--outtype", outtype, *extra_args]
    env = dict(os.environ, NO_LOCAL_GGUF="1", **{PRE_HASHES_ENV: json.dumps(pre_hashes or {})})
    env["PYTHONPATH"] = os.pathsep.join([str(src / "gguf-py"), str(src), str(Path(__file__).resolve().parents[1])])
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if r.returncode != 0 or not tmp.is_file():
        tmp.unlink(missing_ok=True)
        raise ToolError(f"convert_hf_to_gguf.py failed (rc={r.returncode}) on {hf_dir}:\n"
                        f"{(r.stdout + r.stderr)[-4000:]}\nreproduce: PYTHONPATH={env['PYTHONPATH']} {' '.join(cmd)}")
    os.replace(tmp, out)
    return out


def converter_chktxt(src: Path) -> str:
    """The text whose tokenization the converter hashes to recognise a BPE pre-tokenizer (read from its source)."""
    import ast

    tree = ast.parse((src / "conversion" / "base.py").read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name == "get_vocab_base_pre":
            for st in node.body:
                if isinstance(st, ast.Assign) and getattr(st.targets[0], "id", None) == "chktxt":
                    return ast.literal_eval(st.value)
    raise ToolError(f"no chktxt in {src}/conversion/base.py get_vocab_base_pre(): the converter's layout changed")


def pre_tokenizer_hash(tokenizer, src: Path) -> str:
    """The converter's hash of a tokenizer: sha256 of str(tokenizer.encode(chktxt))."""
    import hashlib

    return hashlib.sha256(str(tokenizer.encode(converter_chktxt(src))).encode()).hexdigest()


def _run_converter(src: Path, argv: list[str]) -> None:
    """In the converter's subprocess: teach it the extra pre-tokenizer hashes, then run it as __main__."""
    import runpy

    extra = json.loads(os.environ.get(PRE_HASHES_ENV) or "{}")
    if extra:
        from conversion import base

        known = base.TextModel.get_vocab_base_pre

        def get_vocab_base_pre(self, tokenizer):
            try:
                return known(self, tokenizer)
            except NotImplementedError:  # "BPE pre-tokenizer was not recognized"
                name = extra.get(pre_tokenizer_hash(tokenizer, src))
                if name is None:
                    raise
                return name

        base.TextModel.get_vocab_base_pre = get_vocab_base_pre
    sys.argv = [str(src / "convert_hf_to_gguf.py"), *argv]
    runpy.run_path(sys.argv[0], run_name="__main__")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--run-converter"]:
        _run_converter(Path(argv[1]), argv[2:])
        return 0
    try:
        print(f"llama.cpp source: {ensure_src()}\nllama-quantize:   {ensure_quantize()}")
    except ToolError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
