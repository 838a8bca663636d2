"""Shared fixtures: the packaged SmolLM2 (our weights, tokenizer, models, HF's reference), an engine driver,
and tiny random Llama checkpoints written as HF folders and as GGUF files."""
from __future__ import annotations

import faulthandler
import json
import os
import shutil
import sys
import threading
from dataclasses import dataclass, field
import time
from pathlib import Path

import numpy as np
import pytest
import torch

# The test machines have 2 cores and run several test sessions at once: OpenMP contention costs more
# than it gains. Set at import so that module-level code and every fixture run single-threaded too.
torch.set_num_threads(1)

from common.engine.engine import Engine, EngineConfig, TokenEvent  # noqa: E402
from common.engine.kv_cache import KVCache  # noqa: E402
from common.engine.model import Llama  # noqa: E402
from common.engine.output import FinishReason  # noqa: E402
from common.engine.runner import ModelRunner  # noqa: E402

CHAT_QUESTION = "What is the capital of France?"


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

def wait_idle(cluster, timeout_s: float = 15.0) -> None:
    """An in-process cluster at rest: every pool all-free and consistent, no KV parked, no sequence
    left, and no lease left in Redis; raises the last failed check after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            cluster.check_integrity()
            for w in cluster.decode:
                # The sweep drops only KV older than the KV wait (30 s): anything parked now was leaked
                # by a push nobody claimed, and must not be there.
                w.inbox.sweep()
                assert w.engine.num_parked == 0 and w.inbox.num_parked == 0, \
                    f"{w.config.worker_id}: KV of {w.engine.num_parked} pushes left parked"
            for w in cluster.decode + cluster.prefill:
                pool = w.engine.pool
                assert pool.num_free_blocks == pool.num_blocks, \
                    f"{w.config.worker_id}: {pool.num_used_blocks} KV blocks still used"
                assert w.engine.num_active == 0, f"{w.config.worker_id}: {w.engine.num_active} sequences left"
            for w in cluster.decode:
                leases = cluster.state.reservations(w.config.worker_id)
                assert not leases, f"{w.config.worker_id}: reservations left in Redis: {leases}"
            return
        except AssertionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


# --------------------------------------------------------------------------- SmolLM2 (the packaged GGUF)

def native_kernels():
    """The decode kernels built for this CPU; the test is skipped where no C compiler is (the engine then
    runs its torch paths), and fails where one is but the build did not succeed."""
    from common.engine import native
    if shutil.which("cc") is None:
        pytest.skip("no C compiler: decode runs its torch paths here")
    k = native.kernel()
    assert k is not None, "the kernels did not build although a compiler is there: see the log"
    return k


def skip_where_bf16_is_emulated(what: str) -> None:
    """Skip a bf16 case that an fp32 case covers on hosts whose CPU has no native bf16 (AVX2 only), where
    `auto` serves fp32 and torch's bf16 GEMMs are emulated (prefill 5-6x slower): the case still runs on
    every host with native bf16, where bf16 is the default."""
    from common.engine.hardware import auto_dtype
    if auto_dtype()[0] != torch.bfloat16:
        pytest.skip(f"{what}: bf16 is emulated on this CPU (auto serves fp32 here, whose case covers it)")


def other_build(tmp_path: Path, march: str, extra: tuple[str, ...] = ()):
    """The decode kernels built for another -march into tmp_path (x86-64: the plain C loops; x86-64-v3: the
    image's portable AVX2 build; extra flags after it, e.g. -mno-avx2), for tests that compare builds bit
    for bit."""
    from common.engine.native import build
    from common.engine.native.bindings import DecodeKernels
    if shutil.which("cc") is None:
        pytest.skip("no C compiler")
    path = tmp_path / f"decode_kernels-{march}{''.join(extra)}.so"
    build.compile_library(build.find_compiler(), build.march_flags(march) + list(extra), path)
    return DecodeKernels(path)


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
    """A factory of our Llama over the session's weights, one per (dtype, int4): models hold no state."""
    cache: dict = {}

    def get(dtype: torch.dtype = torch.float32, int4: bool = False, native_matmuls: bool | str | None = None) -> Llama:
        key = (dtype, int4, native_matmuls)
        if key not in cache:
            w = smollm2_weights
            model = Llama(w.config, w.tensors, dtype=dtype, int4=w.int4 if int4 else None,
                          native_matmuls=native_matmuls)
            model.weights_id = w.weights_id
            cache[key] = model
        return cache[key]

    return get


@pytest.fixture(scope="session")
def make_runner(smollm2_model):
    """make_runner(num_blocks, dtype=fp32, block_size=16, int4_decode=False, native_matmuls=None) → a
    ModelRunner with a fresh cache (native_matmuls: see Llama; None picks by the CPU, as a worker does)."""

    def make(num_blocks: int = 256, dtype: torch.dtype = torch.float32, block_size: int = 16,
             int4_decode: bool = False, native_matmuls: bool | str | None = None) -> ModelRunner:
        model = smollm2_model(dtype, int4=int4_decode, native_matmuls=native_matmuls)
        assert not int4_decode or model.has_int4, "the int4 path needs bf16 and a Q4 GGUF"
        cache = KVCache(model.config, num_blocks, block_size, dtype)
        return ModelRunner(model, cache, int4_decode)

    return make


@pytest.fixture(scope="session")
def make_engine(make_runner, smollm2_tokenizer):
    """make_engine(num_blocks=256, dtype=fp32, int4_decode=False, **EngineConfig fields) → an Engine (not started)."""

    def make(num_blocks: int = 256, dtype: torch.dtype = torch.float32, int4_decode: bool = False,
             block_size: int = 16, **config) -> Engine:
        runner = make_runner(num_blocks, dtype, block_size, int4_decode)
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


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """HF generate(do_sample=False) with no EOS (it runs on through one, as ignore_eos does): the new tokens.

    eos_token_id=[]: None would fall back to the model's generation_config, which stops on EOS.
    """
    from transformers import GenerationConfig
    config = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=[], pad_token_id=0)
    with torch.inference_mode():
        input_ids = torch.tensor([prompt_ids])
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), generation_config=config)
    new = out[0, len(prompt_ids):].tolist()
    assert len(new) == max_new_tokens, f"HF stopped after {len(new)} tokens"
    return new


# --------------------------------------------------------------------------- driving an Engine

@dataclass
class Collected:
    """Everything one sequence streamed."""

    events: list[TokenEvent] = field(default_factory=list)

    @property
    def token_ids(self) -> list[int]:
        return [t for e in self.events for t in e.token_ids]

    @property
    def text(self) -> str:
        return "".join(e.text for e in self.events)

    @property
    def done(self) -> bool:
        # A prefill_only engine ends a sequence with finish_reason None and the exported K/V.
        return bool(self.events) and (self.events[-1].finish_reason is not None or self.events[-1].kv is not None)

    @property
    def finish_reason(self) -> FinishReason | None:
        return self.events[-1].finish_reason if self.events else None

    @property
    def error(self) -> str | None:
        return self.events[-1].error if self.events else None

    @property
    def kv(self):
        return self.events[-1].kv if self.events else None


class Sinks(dict):
    """seq_id → Collected; sink(seq_id) is the callback to hand to Engine.submit."""

    def sink(self, seq_id: str):
        collected = self.setdefault(seq_id, Collected())

        def receive(event: TokenEvent) -> None:
            assert event.seq_id == seq_id
            assert not collected.done, f"{seq_id}: event after the last one: {event}"
            collected.events.append(event)

        return receive


def run_until_done(engine: Engine, sinks: Sinks, max_steps: int = 2000) -> int:
    """Step the engine synchronously until every sink got its last event; returns the steps taken."""
    for n in range(max_steps):
        if all(c.done for c in sinks.values()) and engine.num_active == 0:
            return n
        engine.step()
    raise AssertionError(f"engine did not finish in {max_steps} steps: "
                         f"{ {k: len(c.token_ids) for k, c in sinks.items() if not c.done} }")


# --------------------------------------------------------------------------- tiny random Llama checkpoints

TINY_LLAMA = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False)  # not the 1e4 default


def tiny_hf_llama(seed: int = 0, **overrides):
    """A random-weight transformers LlamaForCausalLM (fp32, eval), norms randomised too."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    config = LlamaConfig(**{**TINY_LLAMA, **overrides})
    model = LlamaForCausalLM(config).float().eval()
    with torch.no_grad():  # norm weights start at 1; random ones catch a norm read from the wrong tensor
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(0.08 * torch.randn_like(p))  # larger than the init's 0.02: logits far from uniform
    return model


def save_hf_folder(model, folder: Path) -> Path:
    """config.json + model.safetensors (one shard) through save_pretrained."""
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def llama_cpp_permute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py's LlamaModel.permute (HF rotate_half rows → interleaved pairs)."""
    return (w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


_HF_TO_GGUF_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def write_llama_gguf(model, path: Path, arch: str = "llama") -> Path:
    """The HF model's weights as an F32 GGUF, named and permuted the way llama.cpp's converter writes them."""
    import gguf
    cfg = model.config
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # tied: llama.cpp writes no output.weight, the embedding serves as the LM head
        w = t.detach().float().numpy().copy()
        if name == "model.embed_tokens.weight":
            gname = "token_embd.weight"
        elif name == "model.norm.weight":
            gname = "output_norm.weight"
        elif name == "lm_head.weight":
            gname = "output.weight"
        else:
            _, _, idx, rest = name.split(".", 3)
            gname = f"blk.{idx}.{_HF_TO_GGUF_LAYER[rest]}"
            if rest == "self_attn.q_proj.weight":
                w = llama_cpp_permute(w, cfg.num_attention_heads)
            elif rest == "self_attn.k_proj.weight":
                w = llama_cpp_permute(w, cfg.num_key_value_heads)
        # numpy's [out, in] is written as GGUF dims (in, out): the writer reverses the order itself.
        writer.add_tensor(gname, np.ascontiguousarray(w, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_json(path: Path, obj) -> Path:
    path.write_text(json.dumps(obj))
    return path
