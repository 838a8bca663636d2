"""Shared fixtures: the packaged SmolLM2 (our weights, tokenizer, models, HF's reference), an engine driver,
and tiny random Llama checkpoints written as HF folders and as GGUF files."""
from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

# The test machines have 2 cores and run several test sessions at once: OpenMP contention costs more
# than it gains. Set at import so that module-level code and every fixture run single-threaded too.
torch.set_num_threads(1)

from common.engine.engine import Engine, EngineConfig  # noqa: E402
from common.engine.kv_cache import KVCache  # noqa: E402
from common.engine.model import Llama  # noqa: E402
from common.engine.runner import ModelRunner  # noqa: E402
from tests.support.engine import CHAT_QUESTION  # noqa: E402


# --------------------------------------------------------------------------- a memory guard

# A test that runs away with memory gets the whole run killed by the kernel, with nothing in the log but
# "Killed". Past this many GiB of resident memory the run stops itself instead and prints every thread's
# stack: the test, and the line, that asked for it. The whole suite's process peaked at 8.5 GiB on a 24 GB
# machine (bf16 host; its fixtures and freed-but-kept heap add up); the fuzz input that got CI killed
# asked for 17 GB at once.
MAX_RSS_GIB = float(os.environ.get("HANDOFF_TEST_MAX_RSS_GIB", "16"))


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _guard_memory(config: pytest.Config) -> None:
    while True:
        time.sleep(0.25)
        rss = _rss_bytes()
        if rss > MAX_RSS_GIB * 2**30:
            capture = config.pluginmanager.getplugin("capturemanager")
            if capture is not None:
                capture.suspend_global_capture(in_=True)
            print(f"\nmemory guard: the test process holds {rss / 2**30:.1f} GiB, over "
                  f"HANDOFF_TEST_MAX_RSS_GIB={MAX_RSS_GIB:g}; stopping the run before the kernel kills it. "
                  f"Every thread's stack (the test's is the one under pytest):", file=sys.stderr, flush=True)
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
            sys.stderr.flush()
            os._exit(3)


def pytest_configure(config: pytest.Config) -> None:
    if os.path.exists("/proc/self/statm"):
        threading.Thread(target=_guard_memory, args=(config,), name="memory-guard", daemon=True).start()


# --------------------------------------------------------------------------- in-process clusters


# --------------------------------------------------------------------------- SmolLM2 (the packaged GGUF)


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    from common.engine.model_files import resolve_model_path
    return resolve_model_path("smollm2")


@pytest.fixture(scope="session")
def smollm2_weights(smollm2_path):
    from common.engine.weights import load_weights
    return load_weights(smollm2_path, progress=False)


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_path):
    from common.engine.tokenizer import load_tokenizer
    return load_tokenizer(smollm2_path)


@pytest.fixture(scope="session")
def smollm2_model(smollm2_weights):
    """A factory of our Llama over the session's weights, one per (dtype, packed): models hold no state."""
    cache: dict = {}

    def get(dtype: torch.dtype = torch.float32, packed: bool = False,
            native_matmuls: bool | str | None = None) -> Llama:
        key = (dtype, packed, native_matmuls)
        if key not in cache:
            w = smollm2_weights
            model = Llama(w.config, w.tensors, dtype=dtype, packed=w.packed if packed else None,
                          native_matmuls=native_matmuls)
            model.weights_id = w.weights_id
            cache[key] = model
        return cache[key]

    return get


@pytest.fixture(scope="session")
def make_runner(smollm2_model):
    """make_runner(num_blocks, dtype=fp32, block_size=16, packed_decode=False, native_matmuls=None) → a
    ModelRunner with a fresh cache (native_matmuls: see Llama; None picks by the CPU, as a worker does)."""

    def make(num_blocks: int = 256, dtype: torch.dtype = torch.float32, block_size: int = 16,
             packed_decode: bool = False, native_matmuls: bool | str | None = None) -> ModelRunner:
        model = smollm2_model(dtype, packed=packed_decode, native_matmuls=native_matmuls)
        assert not packed_decode or model.has_packed, "the packed path needs a GGUF of packed formats"
        cache = KVCache(model.config, num_blocks, block_size, dtype)
        return ModelRunner(model, cache, packed_decode)

    return make


@pytest.fixture(scope="session")
def make_engine(make_runner, smollm2_tokenizer):
    """make_engine(num_blocks=256, dtype=fp32, packed_decode=False, **EngineConfig fields) → an Engine (not started)."""

    def make(num_blocks: int = 256, dtype: torch.dtype = torch.float32, packed_decode: bool = False,
             block_size: int = 16, **config) -> Engine:
        runner = make_runner(num_blocks, dtype, block_size, packed_decode)
        return Engine(runner, smollm2_tokenizer, EngineConfig(**config))

    return make


@pytest.fixture(scope="session")
def chat_ids(smollm2_tokenizer):
    """chat_ids(question) → token ids of a one-turn chat prompt with the generation prompt."""

    def ids(question: str = CHAT_QUESTION) -> list[int]:
        tok = smollm2_tokenizer
        return tok.encode(tok.apply_chat_template([{"role": "user", "content": question}]))

    return ids


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_path):
    """HF transformers on the same GGUF, fp32: the numerical reference (about 15 s to load)."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(str(smollm2_path.parent), gguf_file=smollm2_path.name,
                                                 dtype=torch.float32)
    return model.eval()


@pytest.fixture
def bench_systems(hf_smollm2):
    """The engine benchmark's two systems in the dtype this host serves, as `make bench` picks it (bf16
    where the CPU has it natively, else fp32, sharing the session's HF reference): (dtype name, Ours, HF)."""
    from bench import engine
    from common.engine.hardware import auto_dtype
    from common.engine.runner import DTYPE_NAMES
    dtype = auto_dtype()[0]
    name = DTYPE_NAMES[dtype]
    return name, engine.Ours(name, num_blocks=32), engine.HF(name, hf_smollm2 if dtype == torch.float32 else None)


# --------------------------------------------------------------------------- driving an Engine


# --------------------------------------------------------------------------- tiny random Llama checkpoints


