"""python -m bench.engine: the engine alone against HF transformers and llama.cpp, same weights, same run.

    python -m bench.engine                    # every figure, dtype auto (a few minutes)
    python -m bench.engine --quick            # CI smoke: small sizes, under 2 minutes
    python -m bench.engine --only prefill decode --dtype fp32
    python -m bench.engine --profile          # top ops of one decode step at batch 1 and 32 (stderr)
    python -m bench.engine --device cuda --quick --only prefill decode   # ours and HF on the GPU

Prints one JSON object per figure on stdout: {"name", "value", "unit"}, plus "peer", "peer_value" and
"ratio" (= value / peer_value) where the peer ran in the same process; "target" and "met" where the
project has a goal for the figure. Progress goes to stderr.

On a shared 2-core machine absolute times swing from run to run; only ratios within one run mean
anything. So ours and the peer alternate (A/B/B/A...) in every section and each figure is a median.
The peer is HF transformers on the same GGUF file with its weights unpacked to dense tensors of the same
dtype (`GgufConfig(dequantize=True)`, asked for explicitly so that the peer stays dense whichever GGUF
kernels a newer transformers finds installed; here its default load gave the same plain nn.Linear layers).

The second peer is llama.cpp (llama-cpp-python, `bench/llamacpp.py`) on the same file with its
own packed-weight kernels, fed the same token ids, with the same thread count: prefill at 128 and 512
tokens and decode at one stream (at 107 and 1,024 tokens) take turns with ours in the same sections. It
is optional (`make bench-peers`); without it one line {"name": "llama_cpp_peer", "skipped", "how",
"figures"} says which figures were left out and how to get them.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING

import torch

from common import cli
from bench import llamacpp
from bench.harness import (MODEL, base_parser, chat_prompt, emit, emit_load_avg, emit_machine, emit_skipped, interleave,
                           log, system_prompt)

if TYPE_CHECKING:
    from bench.bandwidth import ReadBandwidth
    from bench.llamacpp import LlamaCpp

CHAT_PROMPT_LEN = 107  # the decode context the figures use: a 107-token chat prompt
LONG_CONTEXT = 1024  # one stream again at a long context, where attention is most of a step (not in --quick)
SECTIONS = ("bandwidth", "prefill", "decode", "memory", "dtypes", "prefix")
GPU_SECTIONS = ("prefill", "decode", "prefix")  # what --device cuda measures
PEER = "hf-transformers"
LLAMA_CPP_PREFILL_LENS = (128, 512)  # the prompt lengths llama.cpp prefills (the issue's; 2,048 is HF's alone)


def same_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens two outputs share."""
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def quiet_hf() -> None:
    import transformers
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


# ----------------------------------------------------------------------------- the two systems

def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work: a GPU call returns before its kernels run, so a timing without
    this measures their launch."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Ours:
    name = "handoff"

    def __init__(self, dtype: str, num_blocks: int, device: str = "cpu"):
        from common.engine.model_files import resolve_model_path
        from common.engine.runner import ModelRunner
        from common.engine.tokenizer import load_tokenizer

        self.runner = ModelRunner.load(MODEL, dtype=dtype, num_blocks=num_blocks, progress=False, device=device)
        self.model = self.runner.model
        self.device = self.model.device
        self.tokenizer = load_tokenizer(resolve_model_path(MODEL))

    def prefill_s(self, ids: list[int]) -> float:
        from common.engine.runner import PrefillItem

        pool = self.runner.cache.pool
        pool.allocate("prefill", len(ids) + 1)
        try:
            t0 = time.perf_counter()
            self.runner.prefill([PrefillItem("prefill", ids)])
            synchronize(self.device)
            return time.perf_counter() - t0
        finally:
            pool.free("prefill")


class HF:
    name = PEER

    def __init__(self, dtype: str, model=None, device: str = "cpu"):
        """model: an HF model of the same GGUF already loaded in `dtype` (tests share one rather than load
        their own: docs/benchmarks.md, "Figures behind the code": Tests share one HF model), else it is
        loaded here, onto `device`."""
        from transformers import AutoModelForCausalLM, GgufConfig

        from common.engine.model_files import resolve_model_path
        from common.engine.runner import parse_dtype

        quiet_hf()
        if model is not None:
            assert model.dtype == parse_dtype(dtype), (model.dtype, dtype)
            self.model = model
            self.device = model.device
            return
        p = resolve_model_path(MODEL)
        self.model = AutoModelForCausalLM.from_pretrained(
            str(p.parent), gguf_file=p.name, dtype=parse_dtype(dtype, device),
            quantization_config=GgufConfig(dequantize=True)).eval().to(device)
        self.device = self.model.device

    @torch.inference_mode()
    def prefill_s(self, ids: list[int]) -> float:
        x = torch.tensor([ids], device=self.device)
        t0 = time.perf_counter()
        # logits_to_keep=1: only the last position's logits, as generate() asks for in a prefill.
        self.model(input_ids=x, use_cache=True, logits_to_keep=1)
        synchronize(self.device)
        return time.perf_counter() - t0


# ----------------------------------------------------------------------------- decode loops, one per system

class EngineDecode:
    """Ours as serving runs it: Engine.step() driven synchronously (scheduling, sampling, the sink), as a
    decode worker configures it."""

    name = "engine"

    def __init__(self, ours: Ours, prompt_ids: list[int], bsz: int, max_tokens: int):
        from common.engine.engine import Engine, EngineConfig
        from common.engine.sampling import SamplingParams

        # The decode worker's configuration (decode_svc/worker.py): no text work per token, the router
        # detokenizes each stream once. Every serving mode decodes on a decode worker's engine.
        self.engine = Engine(ours.runner, ours.tokenizer, EngineConfig(max_running=max(64, bsz), detokenize=False))
        self.bsz = bsz
        self.tokens: list[list[int]] = [[] for _ in range(bsz)]
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        for i in range(bsz):
            self.engine.submit(f"engine-{i}", prompt_ids, params, partial(self._sink, i), seed=0)
        while self.engine.waiting or len(self.engine.running) < bsz:
            self.engine.step()

    def _sink(self, i: int, ev) -> None:
        if ev.finish_reason is not None and ev.finish_reason.value in ("error", "cancelled") and ev.error:
            raise RuntimeError(f"engine sequence {i} ended: {ev.error}")
        self.tokens[i].extend(ev.token_ids)

    def steps(self, n: int) -> list[float]:
        out = []
        for _ in range(n):
            t0 = time.perf_counter()
            self.engine.step()
            out.append(time.perf_counter() - t0)
        return out

    def close(self) -> None:
        # (Token counts may differ by one: a batch past the prefill budget is admitted over two steps.)
        if len(self.engine.running) != self.bsz:
            raise RuntimeError("engine decode: the batch shrank during the measurement (a sequence finished)")
        for i in range(self.bsz):
            self.engine.cancel(f"engine-{i}")
        self.engine.step()
        self.engine.check_integrity()


class BandwidthPasses:
    """A pass of the bandwidth probe as one more loop in the batch-1 rotation: the memory's speed measured
    in the same spells as the steps it bounds. How fast the memory reads swings, within seconds, with what
    else the host runs (docs/benchmarks.md, "Figures behind the code": Bandwidth measured in turn with the
    steps), so a bound from the run's best pass, set against a median step taken at other moments, mixes
    two machines.

    A pass reads 1 GiB and leaves every cache, and the TLBs, full of its own lines, and in the rotation the
    engine's step always came right after it. With the engine and the bare runner swapped in place,
    whichever came right after the pass was the slower (docs/benchmarks.md, "Figures behind the code": An
    untimed step after each bandwidth pass). In service a decode step follows the previous step, so
    `settle`, where given, is called after each pass, outside its timing: one untimed decode step, so
    that every timed step follows a decode step.
    """

    name = "bandwidth"

    def __init__(self, bandwidth: ReadBandwidth, settle: Callable[[], object] | None = None):
        self.bandwidth = bandwidth
        self.settle = settle

    def steps(self, n: int) -> list[float]:
        out = []
        for _ in range(n):
            out.append(self.bandwidth.one_pass())
            if self.settle is not None:
                self.settle()
        return out

    def close(self) -> None:
        pass


class RunnerDecode:
    """Ours without the engine: ModelRunner.decode and the greedy Sampler, nothing else per step."""

    name = "runner"

    def __init__(self, ours: Ours, prompt_ids: list[int], bsz: int, max_tokens: int, name: str | None = None):
        from common.engine.runner import PrefillItem
        from common.engine.sampling import Sampler, SamplingParams

        self.name = name or type(self).name
        self.runner = ours.runner
        kernels = ours.model.kernels
        self.sampler = Sampler(argmax=kernels.argmax if kernels is not None else None)  # as the engine's
        self.greedy = SamplingParams(temperature=0.0)
        self.seq_ids = [f"{self.name}-{i}" for i in range(bsz)]
        for s in self.seq_ids:
            self.runner.cache.pool.allocate(s, len(prompt_ids) + max_tokens + 1)
        self.next = self._sample(self.runner.prefill([PrefillItem(s, prompt_ids) for s in self.seq_ids]))
        self.pos = len(prompt_ids)

    def _sample(self, logits: torch.Tensor) -> list[int]:
        b = logits.shape[0]
        return self.sampler(logits, [self.greedy] * b, [0] * b, [0] * b, [()] * b, [()] * b).tolist()

    def steps(self, n: int) -> list[float]:
        from common.engine.runner import DecodeItem

        out = []
        for _ in range(n):
            t0 = time.perf_counter()
            logits = self.runner.decode([DecodeItem(s, t, self.pos) for s, t in zip(self.seq_ids, self.next)])
            self.next = self._sample(logits)
            self.pos += 1
            out.append(time.perf_counter() - t0)
        return out

    def close(self) -> None:
        for s in self.seq_ids:
            self.runner.cache.pool.free(s)


class CachedLayersDecode(RunnerDecode):
    """The bare runner with every layer reading layer 0's packed int4 weights (a few MB, so they stay in the
    CPU's caches): a step's instructions without its layers' tens of MB from memory. Its tokens mean
    nothing; its step time set against the runner's says how much of a step the memory costs. Where the
    two are level, the memory is not what holds the step alone (on the AVX2 host the arithmetic is as
    tight: with a third of it gone the step was no faster from memory, docs/benchmarks.md)."""

    name = "runner_cached_layers"

    def __init__(self, ours: Ours, prompt_ids: list[int], bsz: int, max_tokens: int):
        super().__init__(ours, prompt_ids, bsz, max_tokens)
        layers = ours.model.native_layers  # one hn_layer_t a layer: every one becomes layer 0's
        self.cached = type(layers)(*[layers[0]] * len(layers))

    @staticmethod
    def applies(ours: Ours) -> bool:
        """Only where decode runs the native int4 layer stack (native/csrc/layers.c), whose pointers it swaps."""
        return ours.model.native_layers is not None and ours.model.has_packed and ours.runner.packed_decode

    def steps(self, n: int) -> list[float]:
        model = self.runner.model
        layers, model.native_layers = model.native_layers, self.cached
        try:
            return super().steps(n)
        finally:
            model.native_layers = layers


class HFDecode:
    """HF's manual decode loop: B copies of the same prompt (so no padding), its DynamicCache, argmax."""

    name = PEER

    @torch.inference_mode()
    def __init__(self, hf: HF, prompt_ids: list[int], bsz: int, max_tokens: int):
        self.model = hf.model
        out = self.model(input_ids=torch.tensor([prompt_ids] * bsz, device=hf.device), use_cache=True,
                         logits_to_keep=1)
        self.cache = out.cache
        self.next = out.logits[:, -1].argmax(-1, keepdim=True)  # [B, 1]
        self.tokens = [self.next[0, 0].item()]

    @torch.inference_mode()
    def steps(self, n: int) -> list[float]:
        out_s = []
        for _ in range(n):
            t0 = time.perf_counter()
            out = self.model(input_ids=self.next, cache=self.cache, use_cache=True)
            self.cache = out.cache
            self.next = out.logits[:, -1].argmax(-1, keepdim=True)
            ids = self.next.view(-1).tolist()  # the host sync a serving loop pays too
            out_s.append(time.perf_counter() - t0)
            self.tokens.append(ids[0])
        return out_s

    def close(self) -> None:
        self.cache = None


# ----------------------------------------------------------------------------- sections

def warm_up(fn: Callable[[], float], max_calls: int = 8) -> None:
    """Call until a call is no slower than 1.25x the best so far (at least twice): the first calls of a
    shape pick kernels and fault in buffers, and on this VM such a spell can last several calls."""
    best = fn()
    for _ in range(max_calls - 1):
        t = fn()
        if t <= 1.25 * best:
            return
        best = min(best, t)


def bench_prefill(ours: Ours, hf: HF, sizes: dict[int, int], llama: LlamaCpp | None = None) -> None:
    """sizes: prompt length -> rounds. llama.cpp takes its turns at LLAMA_CPP_PREFILL_LENS."""
    for n, rounds in sizes.items():
        _, ids = chat_prompt(ours.tokenizer, n)
        fns = {"ours": partial(ours.prefill_s, ids), "hf": partial(hf.prefill_s, ids)}
        if llama is not None and n in LLAMA_CPP_PREFILL_LENS:
            fns[llamacpp.NAME] = partial(llama.prefill_s, ids)
        for fn in fns.values():
            warm_up(fn)
        t = interleave(fns, rounds)
        tok_s = {who: n / statistics.median(ts) for who, ts in t.items()}
        v, pv = tok_s["ours"], tok_s["hf"]
        log(f"prefill {n}: " + ", ".join(f"{who} {x:.0f}" for who, x in tok_s.items()) + " tok/s")
        emit(f"prefill_tok_s_{n}", v, "tok/s (median of rounds)", peer=PEER, peer_value=pv,
             target="ratio >= 1.0", met=v / pv >= 1.0, prompt_len=n, rounds=rounds,
             best_ratio=min(t["hf"]) / min(t["ours"]))
        if llamacpp.NAME in t:
            emit(f"prefill_tok_s_{n}_vs_llama_cpp", v, "tok/s (median of rounds)", peer=llamacpp.NAME,
                 peer_value=tok_s[llamacpp.NAME], prompt_len=n, rounds=rounds,
                 best_ratio=min(t[llamacpp.NAME]) / min(t["ours"]))


def bench_prefix(dtype: str, rounds: int, device: str = "cpu") -> None:
    """Time to first token with a 1,024-token system prompt the prefix cache holds (warm) against one it
    does not (cold), each with a new 32-token question, alternating: what a prefill worker saves."""
    from common.engine.engine import Engine, EngineConfig
    from common.engine.sampling import SamplingParams

    warm, cold = Ours(dtype, 256, device), Ours(dtype, 256, device)
    tok = warm.tokenizer
    system = system_prompt(tok, "opening hours", 1024)
    engines = {"warm": Engine(warm.runner, tok, EngineConfig(prefill_only=True)),
               "cold": Engine(cold.runner, tok, EngineConfig(prefill_only=True, prefix_caching=False))}
    asked = iter(range(10**6))

    def ttft(who: str) -> float:
        question = f"Question {next(asked)}: is the library open on the first Monday of the month, and when?"
        ids = tok.encode(tok.apply_chat_template([{"role": "system", "content": system},
                                                  {"role": "user", "content": question}]))
        events = []
        t0 = time.perf_counter()
        engines[who].submit(who, ids, SamplingParams(temperature=0.0, max_tokens=1), events.append)
        while not events:
            engines[who].step()
        return time.perf_counter() - t0

    ttft("warm")  # fills the cache
    for who in engines:
        warm_up(partial(ttft, who))
    t = interleave({who: partial(ttft, who) for who in engines}, rounds)
    w, c = statistics.median(t["warm"]), statistics.median(t["cold"])
    n = len(tok.encode(system))
    log(f"prefix: TTFT warm {w * 1e3:.0f} ms, cold {c * 1e3:.0f} ms ({n}-token system prompt)")
    emit("prefix_ttft_ms_warm", w * 1e3, "ms (lower is better; ratio = warm / cold)", peer="cold (no prefix cache)",
         peer_value=c * 1e3, target="ratio <= 0.3", met=w / c <= 0.3, system_tokens=n, rounds=rounds)


def bench_dtypes(num_blocks: int, batches: list[int], steps: int, warmup: int, rounds: int) -> None:
    """Ours in every dtype on this machine, int4 decode on (the default): which one `auto` should pick
    here is a measurement, not a constant. Prefill and decode alternate between the dtypes."""
    from common.engine.hardware import auto_dtype
    from common.engine.runner import DTYPE_NAMES

    picked = DTYPE_NAMES[auto_dtype()[0]]
    systems = {name: Ours(name, num_blocks) for name in ("fp32", "bf16")}
    tokenizer = systems["fp32"].tokenizer
    for n in (128, 512):
        _, ids = chat_prompt(tokenizer, n)
        fns = {name: partial(s.prefill_s, ids) for name, s in systems.items()}
        for fn in fns.values():
            warm_up(fn)
        tok_s = {name: n / statistics.median(ts) for name, ts in interleave(fns, rounds).items()}
        log(f"prefill {n} by dtype: " + ", ".join(f"{k} {v:.0f}" for k, v in tok_s.items()) + " tok/s")
        for name, v in tok_s.items():
            emit(f"prefill_tok_s_{n}_{name}", v, "tok/s (median of rounds)", dtype=name, auto_picks=picked,
                 peer="fp32" if name != "fp32" else None, peer_value=tok_s["fp32"] if name != "fp32" else None)
    _, prompt_ids = chat_prompt(tokenizer, CHAT_PROMPT_LEN)
    for bsz in batches:
        loops = {name: EngineDecode(s, prompt_ids, bsz, warmup + steps + 8) for name, s in systems.items()}
        for loop in loops.values():
            loop.steps(warmup)
        times = {name: [s for r in rs for s in r]
                 for name, rs in interleave({k: partial(loop.steps, 1) for k, loop in loops.items()}, steps).items()}
        tok_s = {name: bsz / statistics.median(ts) for name, ts in times.items()}
        log(f"decode {bsz} seq by dtype: " + ", ".join(f"{k} {v:.1f}" for k, v in tok_s.items()) + " tok/s")
        for name, v in tok_s.items():
            emit(f"decode_tok_s_{bsz}seq_{name}", v, "tok/s (Engine.step, median step, int4 decode)", dtype=name,
                 auto_picks=picked, peer="fp32" if name != "fp32" else None,
                 peer_value=tok_s["fp32"] if name != "fp32" else None)
        for loop in loops.values():
            loop.close()


def step_in_turn(loops: list, rows: int, steps: int, warmup: int,
                 times: dict[str, list[float]] | None = None) -> tuple[dict[str, float], dict[str, float]]:
    """`warmup` steps of each decode loop, then one step of each in turn, `steps` times (a slow spell of the
    shared machine lands on all of them alike). Returns tok/s per loop name: at the median step, at the best;
    `times`, where given, receives each loop's seconds a step in turn."""
    for loop in loops:
        loop.steps(warmup)
    times = {} if times is None else times
    times.update({name: [s for r in rs for s in r]
                  for name, rs in interleave({loop.name: partial(loop.steps, 1) for loop in loops}, steps).items()})
    return ({name: rows / statistics.median(ts) for name, ts in times.items()},
            {name: rows / min(ts) for name, ts in times.items()})


def bench_decode(ours: Ours, hf: HF, batches: list[int], steps: int, warmup: int,
                 bandwidth: ReadBandwidth | None, dtype: str, llama: LlamaCpp | None = None,
                 long_context: int | None = None) -> None:
    """Per batch size: the engine, the bare runner and HF (and llama.cpp at batch 1) step in turn, one step
    each, `steps` times. With `long_context`, one stream again after a prompt of that many tokens. Without
    `bandwidth` (on a GPU: the host memory's speed bounds nothing there), no passes and no bounds."""
    from bench.bandwidth import decode_bound_tok_s
    from common.engine.planner import kv_bytes_per_token

    _, prompt_ids = chat_prompt(ours.tokenizer, CHAT_PROMPT_LEN)
    max_tokens = warmup + steps + 8  # nobody finishes while measured
    targets = {1: 2.0, 32: 1.5}
    engine_tok_s_1 = None
    pass_s: list[float] = []  # the bandwidth passes' seconds, taken in turn with the 1-stream steps
    first_seq_tokens: dict[int, list[int]] = {}  # batch size -> the engine's greedy tokens of sequence 0
    for bsz in batches:
        log(f"decode {bsz} seq: prefilling {bsz} x {CHAT_PROMPT_LEN} tokens in each system")
        loops = [EngineDecode(ours, prompt_ids, bsz, max_tokens), RunnerDecode(ours, prompt_ids, bsz, max_tokens),
                 HFDecode(hf, prompt_ids, bsz, max_tokens)]
        if bsz == 1 and CachedLayersDecode.applies(ours):  # right after the runner: the same predecessor kind
            loops.insert(2, CachedLayersDecode(ours, prompt_ids, bsz, max_tokens))
        if llama is not None and bsz == 1:
            loops.append(llamacpp.LlamaCppDecode(llama, prompt_ids, max_tokens))
        settle = None
        # The pass, then an untimed step of ours: every timed step follows a decode step.
        if bsz == 1 and bandwidth is not None:
            settle = RunnerDecode(ours, prompt_ids, bsz, max_tokens, name="settle")
            loops.append(BandwidthPasses(bandwidth, settle=partial(settle.steps, 1)))
        by_name = {loop.name: loop for loop in loops}
        times: dict[str, list[float]] = {}
        tok_s, best = step_in_turn(loops, bsz, steps, warmup, times)
        if BandwidthPasses.name in times:
            pass_s = times[BandwidthPasses.name]
            for d in (tok_s, best):
                del d[BandwidthPasses.name]
        log(f"decode {bsz} seq: " + ", ".join(f"{name} {x:.1f}" for name, x in tok_s.items()) + " tok/s (median step)")
        goal = targets.get(bsz)
        kw = dict(target=f"ratio >= {goal}", met=tok_s["engine"] / tok_s[PEER] >= goal) if goal else {}
        emit(f"decode_tok_s_{bsz}seq", tok_s["engine"], "tok/s (Engine.step, median step)", peer=PEER,
             peer_value=tok_s[PEER], batch=bsz, context_len=CHAT_PROMPT_LEN, steps=steps,
             best_ratio=best["engine"] / best[PEER], **kw)
        emit(f"decode_runner_tok_s_{bsz}seq", tok_s["runner"], "tok/s (ModelRunner.decode + Sampler, median step)",
             peer=PEER, peer_value=tok_s[PEER], batch=bsz, best_ratio=best["runner"] / best[PEER])
        if CachedLayersDecode.name in tok_s:
            cached = tok_s.pop(CachedLayersDecode.name)
            best.pop(CachedLayersDecode.name)
            emit("decode_1seq_runner_cached_layers_tok_s", cached,
                 "tok/s (the bare runner, every layer reading layer 0's int4 weights from cache; median step)",
                 runner_tok_s=tok_s["runner"], runner_fraction=tok_s["runner"] / cached,
                 layer_weight_bytes=ours.model.decode_layer_weight_bytes(use_packed=True))
        if llamacpp.NAME in tok_s:
            emit(f"decode_tok_s_{bsz}seq_vs_llama_cpp", tok_s["engine"], "tok/s (Engine.step, median step)",
                 peer=llamacpp.NAME, peer_value=tok_s[llamacpp.NAME], batch=bsz, context_len=CHAT_PROMPT_LEN,
                 steps=steps, best_ratio=best["engine"] / best[llamacpp.NAME])
        engine_tokens = by_name["engine"].tokens[0]
        first_seq_tokens[bsz] = engine_tokens
        for peer, label, what in ((PEER, "hf", "HF's"), (llamacpp.NAME, "llama_cpp", "llama.cpp's")):
            if peer in by_name:
                peer_tokens = by_name[peer].tokens
                emit(f"decode_greedy_prefix_match_{label}_{bsz}seq", same_prefix(engine_tokens, peer_tokens),
                     f"tokens of {min(len(engine_tokens), len(peer_tokens))} (sequence 0) equal to {what} "
                     f"greedy output")
        if bsz == 1:
            engine_tok_s_1 = tok_s["engine"]
        for loop in ([settle] if settle else []) + loops[::-1]:  # the engine last: it checks its pool is its own
            loop.close()
        del loops, by_name
        gc.collect()
        if bandwidth is not None:
            bandwidth.measure(2)  # more passes spread over the run: the best one is the machine's
    if 1 in first_seq_tokens:
        # The same prompt decoded alone and inside a batch: shows whether a sequence's tokens depend on
        # its company (invariant 4: same inputs, same tokens); the runner keeps one weight format at every batch size for this.
        for bsz, ids in first_seq_tokens.items():
            if bsz != 1:
                n = min(len(ids), len(first_seq_tokens[1]))
                same = same_prefix(ids, first_seq_tokens[1])
                emit(f"decode_batch_invariant_prefix_1_vs_{bsz}seq", same,
                     f"tokens of {n}: sequence 0's greedy output at batch 1 equal to its output at batch {bsz}",
                     target=f"== {n}", met=same == n)
    if long_context and 1 in batches:
        bench_decode_long(ours, hf, long_context, steps, warmup, llama)
    if bandwidth is None:
        return
    gbs = bandwidth.gbs
    emit("memory_read_bandwidth", gbs, "GB/s (best pass, torch row-sum over fp32)", passes=bandwidth.num_passes,
         tensor_bytes=bandwidth.num_bytes)
    if engine_tok_s_1 is None:
        return
    gbs_in_turn = bandwidth.num_bytes / statistics.median(pass_s) / 1e9
    emit("memory_read_bandwidth_in_turn", gbs_in_turn, "GB/s (median pass, one pass a round of the 1-stream "
         "decode rotation)", passes=len(pass_s), best_pass_gbs=gbs)
    model = ours.model
    use_packed = model.has_packed and ours.runner.packed_decode
    dense_bytes = model.decode_weight_bytes(use_packed=False)
    read_bytes = model.decode_weight_bytes(use_packed=True) if use_packed else dense_bytes
    # A step also reads its sequence's K/V, every layer's, up to its position: at the measured steps'
    # median context (the prompt, the warm-up steps, half the measured ones), 5 % of the weights' bytes
    # at this prompt's length in fp32, as much as the weights from ~2,000 tokens.
    c = model.config
    context = CHAT_PROMPT_LEN + warmup + steps // 2
    kv_bytes = context * kv_bytes_per_token(c.num_layers, c.num_kv_heads, c.head_dim,
                                            ours.runner.cache.kv.element_size())
    # Two bounds a step: at the median pass taken in turn with the steps (the same spells of the shared
    # machine, as every other ratio here), and at the run's best pass (the memory at its quietest moment,
    # set against steps taken at other moments: a lower fraction, the stricter reading). The target is
    # on every byte a step reads (weights as decode reads them, and the K/V); the weights alone are shown.
    read_what = "what a batch-1 step reads of the weights" + (": packed int4 layers + the int8 lm_head" if use_packed
                                                              else "")
    for name, label, weight_bytes, step_kv_bytes, what, target in (
            (f"{dtype}_weights", dtype, dense_bytes, 0, "every weight dense", False),
            ("read_weights", "read", read_bytes, 0, read_what, False),
            ("step", "step", read_bytes, kv_bytes, f"{read_what}, and the K/V of {context} positions", True)):
        nbytes = weight_bytes + step_kv_bytes
        bound = decode_bound_tok_s(gbs_in_turn, nbytes)
        emit(f"decode_1seq_bound_{name}", bound, f"tok/s ({nbytes / 1e6:.1f} MB per step, {what}, "
             "at the median pass in turn)", weight_bytes=weight_bytes, kv_bytes=step_kv_bytes,
             best_pass_bound=decode_bound_tok_s(gbs, nbytes))
        for suffix, at in (("", "the median pass in turn"), ("_best_pass", "the run's best pass")):
            frac = engine_tok_s_1 / decode_bound_tok_s(gbs_in_turn if not suffix else gbs, nbytes)
            kw = dict(target=">= 0.6", met=frac >= 0.6) if target else {}
            emit(f"decode_1seq_fraction_of_bound_{label}{suffix}", frac,
                 f"fraction (engine tok/s at 1 seq, median step / bound at {at})", **kw)
    if model.weight_arena is not None:  # how much of what a step streams the kernel gave huge pages
        from common.engine import pages

        packed = model.weight_arena.chunks
        emit("decode_weights_in_huge_pages", pages.huge_page_bytes(packed) / 1e6,
             f"MB of the {sum(c.numel() for c in packed) / 1e6:.1f} MB packed-weight arena in 2 MiB pages "
             "(AnonHugePages)", transparent_huge_pages=pages.thp_mode(), advised=model.weight_arena.huge)


def bench_decode_long(ours: Ours, hf: HF, context: int, steps: int, warmup: int, llama: LlamaCpp | None) -> None:
    """One stream after a `context`-token chat prompt: the engine, HF and llama.cpp one step each in turn.
    At a long context attention is a large part of a step; at 107 tokens it is not."""
    _, prompt_ids = chat_prompt(ours.tokenizer, context)
    log(f"decode 1 seq at {context} tokens: prefilling in each system")
    loops = [EngineDecode(ours, prompt_ids, 1, warmup + steps + 8), HFDecode(hf, prompt_ids, 1, warmup + steps + 8)]
    if llama is not None:
        loops.append(llamacpp.LlamaCppDecode(llama, prompt_ids, warmup + steps + 8))
    tok_s, best = step_in_turn(loops, 1, steps, warmup)
    log(f"decode 1 seq at {context} tokens: " + ", ".join(f"{n} {x:.1f}" for n, x in tok_s.items())
        + " tok/s (median step)")
    for peer, suffix in ((PEER, ""), (llamacpp.NAME, "_vs_llama_cpp")):
        if peer in tok_s:
            emit(f"decode_tok_s_1seq_ctx{context}{suffix}", tok_s["engine"], "tok/s (Engine.step, median step)",
                 peer=peer, peer_value=tok_s[peer], batch=1, context_len=context, steps=steps,
                 best_ratio=best["engine"] / best[peer])
    for loop in reversed(loops):
        loop.close()


def bench_memory(probes: dict[str, subprocess.Popen]) -> None:
    got = {}
    for who, proc in probes.items():
        out, _ = proc.communicate(timeout=900)
        if proc.returncode != 0:
            raise RuntimeError(f"memory probe {who} failed with exit code {proc.returncode}")
        got[who] = json.loads(out.strip().splitlines()[-1])
    unit = "MiB (lower is better; ratio = ours / peer)"
    for key, what in (("peak_rss_mib", "RSS high-water mark of a process that loads the model, prefills "
                                       "512 tokens and decodes 32 at batch 1 (getrusage)"),
                      ("rss_mib", "resident set after that workload (psutil)")):
        emit(f"memory_{key}", got["ours"][key], unit, peer=PEER, peer_value=got["hf"][key], what=what)


def start_memory_probes(dtype: str, threads: int) -> dict[str, subprocess.Popen]:
    """One fresh process per system, so each high-water mark is its own; they run while we load."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository
    return {who: subprocess.Popen([sys.executable, "-m", "bench.engine", "--memory-probe", who, "--dtype", dtype,
                                   "--threads", str(threads)], stdout=subprocess.PIPE, text=True, cwd=root)
            for who in ("ours", "hf")}


def memory_probe(who: str, dtype: str) -> None:
    import psutil

    prompt_len, steps = 512, 32
    if who == "ours":
        from common.engine.runner import DecodeItem, PrefillItem
        ours = Ours(dtype, num_blocks=-(-(prompt_len + steps + 1) // 16))
        _, ids = chat_prompt(ours.tokenizer, prompt_len)
        ours.runner.cache.pool.allocate("m", prompt_len + steps + 1)
        tok = int(ours.runner.prefill([PrefillItem("m", ids)]).argmax(-1))
        for i in range(steps):
            tok = int(ours.runner.decode([DecodeItem("m", tok, prompt_len + i)]).argmax(-1))
    else:
        from common.engine.model_files import resolve_model_path
        from common.engine.tokenizer import load_tokenizer
        hf = HF(dtype)
        _, ids = chat_prompt(load_tokenizer(resolve_model_path(MODEL)), prompt_len)
        loop = HFDecode(hf, ids, 1, steps)
        loop.steps(steps)
    gc.collect()
    print(json.dumps({"peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                      "rss_mib": psutil.Process().memory_info().rss / 2**20}), flush=True)


def profile_decode(dtype: str) -> None:
    """Top ops (self CPU time) of one ModelRunner.decode + greedy sample at batch 1 and 32, to stderr."""
    from torch.profiler import ProfilerActivity, profile

    ours = Ours(dtype, num_blocks=32 * 16)
    _, prompt_ids = chat_prompt(ours.tokenizer, CHAT_PROMPT_LEN)
    for bsz in (1, 32):
        loop = RunnerDecode(ours, prompt_ids, bsz, 64)
        loop.steps(8)
        n = 10
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            ms = statistics.median(loop.steps(n)) * 1e3
        print(f"\n=== decode batch {bsz}: {ms:.1f} ms per step (median of {n}, profiler on); "
              f"self CPU per step below is over {n} steps ===", file=sys.stderr)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18), file=sys.stderr)
        loop.close()


def llama_cpp_figures(sections: set[str], prefill_sizes: dict[int, int], batches: list[int],
                      long_context: int | None = None) -> list[str]:
    """The figures llama.cpp takes part in, in a run of these sections and sizes."""
    names = [f"prefill_tok_s_{n}_vs_llama_cpp" for n in prefill_sizes
             if n in LLAMA_CPP_PREFILL_LENS and "prefill" in sections]
    if "decode" in sections and 1 in batches:
        names.append("decode_tok_s_1seq_vs_llama_cpp")
        if long_context:
            names.append(f"decode_tok_s_1seq_ctx{long_context}_vs_llama_cpp")
    return names


def load_llama_cpp(figures: list[str], threads: int, n_ctx: int) -> LlamaCpp | None:
    """llama.cpp for these figures, or None, with a line saying how to get them, where it is not installed."""
    if not figures:
        return None
    why = llamacpp.missing_reason()
    if why is not None:
        emit_skipped("llama_cpp_peer", why, llamacpp.HOW_TO_GET, figures=figures)
        return None
    from common.engine.model_files import resolve_model_path
    log(f"loading llama.cpp ({threads} threads, {n_ctx}-token context)")
    return llamacpp.LlamaCpp(resolve_model_path(MODEL), threads, n_ctx)


# ----------------------------------------------------------------------------- main

def main(argv: list[str] | None = None) -> None:
    p = base_parser("python -m bench.engine", __doc__, SECTIONS)
    cli.add_switch(p, "--profile", "profile one decode step at batch 1 and 32 (stderr)")
    p.add_argument("--memory-probe", choices=("ours", "hf"), help=argparse.SUPPRESS)
    p.add_argument("--device", default="cpu",
                   help=f"cpu, or cuda[:N]: ours and HF on the GPU, sections {', '.join(GPU_SECTIONS)} only (the "
                        "others measure the host: its memory bandwidth, RSS, its dtypes; llama.cpp runs on the CPU)")
    args = p.parse_args(argv)
    on_gpu = torch.device(args.device).type != "cpu"
    if on_gpu and args.only and not set(args.only) <= set(GPU_SECTIONS):
        p.error(f"--device {args.device}: --only takes {', '.join(GPU_SECTIONS)}")
    if on_gpu and (args.profile or args.memory_probe):
        p.error(f"--device {args.device}: --profile and the memory probes measure the CPU")
    torch.set_num_threads(args.threads)
    if args.memory_probe:
        return memory_probe(args.memory_probe, args.dtype)
    if args.profile:
        return profile_decode(args.dtype)
    q = args.quick
    # --quick leaves out the memory probes (two more model loads) unless --only names them.
    sections = set(args.only or (set(SECTIONS) - {"memory"} if q else SECTIONS))
    if on_gpu:
        sections &= set(GPU_SECTIONS)
    prefill_sizes = {128: 5} if q else {128: 15, 512: 9, 2048: 5}
    batches = [1, 8] if q else [1, 8, 32]
    steps, warmup = (16, 4) if q else (64, 8)
    long_context = None if q else LONG_CONTEXT
    t_start = time.perf_counter()
    from common.engine import pages
    from common.engine.hardware import auto_dtype
    from common.engine.native.choice import matmuls_mode
    from common.engine.runner import DTYPE_NAMES

    asked = args.dtype
    args.dtype = DTYPE_NAMES[auto_dtype(args.device)[0]] if asked == "auto" else asked
    log(f"dtype {args.dtype}{' (auto)' if asked == 'auto' else ''}, {args.threads} threads, device {args.device}, "
        f"sections {sorted(sections)}{' (quick)' if q else ''}")
    gpu = dict(gpu=torch.cuda.get_device_name(args.device), torch_cuda=torch.version.cuda) if on_gpu else {}
    emit_machine(dtype=args.dtype, dtype_asked=asked, why=auto_dtype(args.device)[1], threads=args.threads,
                 device=args.device, decode_matmuls=matmuls_mode()[1] if not on_gpu else "torch (GPU)",
                 transparent_huge_pages=pages.thp_mode(), huge_pages=pages.enabled(), **gpu)
    emit_load_avg("start")

    probes = start_memory_probes(args.dtype, args.threads) if "memory" in sections else {}
    ours = hf = llama = None
    if sections & {"prefill", "decode"}:
        log("loading ours and HF" + (" (the memory probes load in parallel)" if probes else ""))
        max_tokens = warmup + steps + 16
        num_blocks = max(max(prefill_sizes) // 16 + 1,
                         2 * max(batches) * -(-(CHAT_PROMPT_LEN + max_tokens) // 16),
                         2 * -(-((long_context or 0) + max_tokens) // 16))
        ours, hf = Ours(args.dtype, num_blocks, args.device), HF(args.dtype, device=args.device)
        if not on_gpu:  # llama.cpp here is a CPU build: no peer of ours on a GPU
            llama = load_llama_cpp(llama_cpp_figures(sections, prefill_sizes, batches, long_context),
                                   args.threads, n_ctx=max(*LLAMA_CPP_PREFILL_LENS,
                                                           (long_context or CHAT_PROMPT_LEN) + max_tokens))
    if probes:
        log("waiting for the memory probes")
        bench_memory(probes)
    bandwidth = None
    if sections & {"bandwidth", "decode"} and not on_gpu:
        from bench.bandwidth import ReadBandwidth
        bandwidth = ReadBandwidth((256 << 20) if q else (1 << 30))
        bandwidth.measure(4)
        if "decode" not in sections:
            bandwidth.measure(4)
            emit("memory_read_bandwidth", bandwidth.gbs, "GB/s (best pass, torch row-sum over fp32)",
                 passes=bandwidth.num_passes, tensor_bytes=bandwidth.num_bytes)
    if "prefill" in sections:
        bench_prefill(ours, hf, prefill_sizes, llama)
    if "decode" in sections:
        bench_decode(ours, hf, batches, steps, warmup, bandwidth, args.dtype, llama, long_context)
    if "prefix" in sections:
        bench_prefix(args.dtype, 5 if q else 9, args.device)
    if "dtypes" in sections:
        del ours, hf
        gc.collect()
        bench_dtypes(max(2 * max(batches) * -(-(CHAT_PROMPT_LEN + steps + warmup + 16) // 16), 512 // 16 + 1),
                     batches[:2], steps, warmup, 5 if q else 9)
    emit_load_avg("end")
    log(f"done in {time.perf_counter() - t_start:.0f} s")


if __name__ == "__main__":
    main()
