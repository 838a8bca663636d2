"""llama.cpp as the engine benchmark's second peer, through llama-cpp-python on the same GGUF file.

llama.cpp runs its own kernels on the file's packed Q4_1 weights; ours decodes the same blocks (codes and
scales as stored, laid out for its kernels) and prefills with dense copies in the dtype.
Both get the same token ids (ours tokenizes, llama.cpp only evaluates), the same thread count and
greedy decoding. llama-cpp-python is optional: pip compiles llama.cpp for several minutes, so it is
not in requirements*.txt and `make bench-peers` installs it.
"""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np

NAME = "llama.cpp"
HOW_TO_GET = ("`make bench-peers` installs llama-cpp-python into .venv, or rebuilds it there "
              "(it compiles llama.cpp, without its AMX kernels, 3-7 minutes on 2 cores)")


def missing_reason() -> str | None:
    """Why llama-cpp-python cannot be used in this environment, or None when it can."""
    try:
        import llama_cpp  # noqa: F401  (loads the compiled library too)
    except (ImportError, OSError) as e:
        return f"llama_cpp is not importable ({type(e).__name__}: {e})"
    from common.engine.hardware import cpu_flags
    return amx_reason(llama_cpp.llama_print_system_info().decode(errors="replace"), cpu_flags())


def amx_reason(system_info: str, flags: frozenset[str]) -> str | None:
    """Why a llama.cpp build must not run here, or None: one built with its AMX kernels (its system info
    says AMX_INT8 = 1) on a CPU that has AMX. On the Intel VM with AMX, llama-cpp-python 0.3.36's AMX
    matmul faulted at the first prompt (general protection fault at ldtilecfg in ggml_backend_amx_mul_mat,
    llama.cpp issue 20824) and took the whole benchmark down; `make bench-peers` builds it without them."""
    if "amx_tile" in flags and "AMX_INT8 = 1" in system_info:
        return ("this llama.cpp build has its AMX kernels, which crash on this CPU (a general protection "
                "fault in ggml_backend_amx_mul_mat, llama.cpp issue 20824)")
    return None


class LlamaCpp:
    """One llama.cpp context (a single sequence) over the model file."""

    name = NAME

    def __init__(self, model_path: Path, threads: int, n_ctx: int):
        from llama_cpp import Llama

        # n_batch = n_ubatch = n_ctx: a prompt is one forward, as in ours. use_mmap=False reads the
        # weights into memory at load, so no page faults land in a measured call. flash_attn=True is what
        # llama.cpp's own default (auto) picks on a CPU; the binding's False turns it off, which was
        # slower (docs/benchmarks.md, "Figures behind the code": llama.cpp with flash attention).
        self.llm = Llama(model_path=str(model_path), n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx,
                         n_threads=threads, n_threads_batch=threads, flash_attn=True, use_mmap=False,
                         verbose=False)
        self.n_vocab = self.llm.n_vocab()

    def reset(self) -> None:
        """Empty the KV cache, so that the next eval() computes every position of its tokens."""
        import llama_cpp

        self.llm.reset()  # the binding's count of evaluated tokens, where its next eval() starts
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(self.llm.ctx), True)

    def prefill_s(self, ids: list[int]) -> float:
        self.reset()
        t0 = time.perf_counter()
        self.llm.eval(ids)
        return time.perf_counter() - t0

    def num_cached(self) -> int:
        """Positions in the KV cache (the highest cached position + 1; 0 when empty)."""
        import llama_cpp

        return llama_cpp.llama_memory_seq_pos_max(llama_cpp.llama_get_memory(self.llm.ctx), 0) + 1

    def greedy_next(self) -> int:
        """argmax of the last evaluated position's logits (eval() keeps them only inside llama.cpp)."""
        import llama_cpp

        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(self.llm.ctx, -1), shape=(self.n_vocab,))
        return int(logits.argmax())


class LlamaCppDecode:
    """llama.cpp's decode at one stream: eval one token, argmax its logits, as HFDecode does."""

    name = NAME

    def __init__(self, peer: LlamaCpp, prompt_ids: list[int], max_tokens: int):
        if len(prompt_ids) + max_tokens > peer.llm.n_ctx():
            raise ValueError(f"llama.cpp context of {peer.llm.n_ctx()} tokens is too small for "
                             f"{len(prompt_ids)} + {max_tokens}")
        self.peer = peer
        peer.prefill_s(prompt_ids)
        self.next = peer.greedy_next()
        self.tokens = [self.next]

    def steps(self, n: int) -> list[float]:
        out_s = []
        for _ in range(n):
            t0 = time.perf_counter()
            self.peer.llm.eval([self.next])
            self.next = self.peer.greedy_next()
            out_s.append(time.perf_counter() - t0)
            self.tokens.append(self.next)
        return out_s

    def close(self) -> None:
        self.peer.reset()
