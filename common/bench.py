"""python -m common.bench: the engine alone against HF transformers, same weights, same dtype, same run.

    python -m common.bench                         # every figure, bf16 (a few minutes)
    python -m common.bench --quick                 # CI smoke: small sizes, under 2 minutes
    python -m common.bench --only prefill decode --dtype fp32
    python -m common.bench --profile               # top ops of one decode step at batch 1 and 32 (stderr)

Prints one JSON object per figure on stdout: {"name", "value", "unit"}, plus "peer", "peer_value" and
"ratio" (= value / peer_value) where the peer ran in the same process; "target" and "met" where the
project has a goal for the figure. Progress goes to stderr.

On a shared 2-core machine absolute times swing from run to run; only ratios within one run mean
anything. So ours and the peer alternate (A/B/B/A...) in every section and each figure is a median.
The peer is HF transformers with the GGUF's weights unpacked to dense tensors of the same dtype (its
`dequantize=True` path: its default keeps GGUF blocks packed and is many times slower on this CPU).
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

import torch

MODEL = "smollm2"
CHAT_PROMPT_LEN = 107  # DESIGN.md's decode context: a 107-token chat prompt
SECTIONS = ("bandwidth", "prefill", "decode", "memory")
PEER = "hf-transformers"


# ----------------------------------------------------------------------------- output, shared with router.bench

def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _num(x: float) -> float | int:
    if isinstance(x, int):
        return x
    return float(f"{x:.4g}")


def emit(name: str, value: float, unit: str, *, peer: str | None = None, peer_value: float | None = None,
         ratio: float | None = None, target: str | None = None, met: bool | None = None, **extra) -> dict:
    """Print one figure as a JSON line. ratio defaults to value / peer_value."""
    rec: dict = {"name": name, "value": _num(value), "unit": unit}
    if peer is not None:
        rec["peer"] = peer
        rec["peer_value"] = _num(peer_value)
        rec["ratio"] = _num(ratio if ratio is not None else value / peer_value)
    if target is not None:
        rec["target"] = target
        rec["met"] = bool(met)
    rec.update({k: _num(v) if isinstance(v, float) else v for k, v in extra.items()})
    print(json.dumps(rec), flush=True)
    return rec


def percentile(xs: list[float], q: float) -> float:
    """Linear-interpolated q-th percentile (numpy's default); with n samples p99 is near the max."""
    s = sorted(xs)
    k = (len(s) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def chat_prompt(tokenizer, num_tokens: int) -> tuple[str, list[int]]:
    """A one-turn chat prompt (the model's template) of exactly `num_tokens` tokens: (text, ids).

    The user turn repeats words that are one token each with a leading space, so every added word adds
    exactly one token; the text re-encodes to the same ids, which the router's `prompt` field needs.
    """
    words = ("Please explain in simple words why the sky is blue during the day and red at night and "
             "what the air does to the light of the sun when it goes through it on the way to our").split()

    def render(k: int) -> str:
        body = " ".join(words[i % len(words)] for i in range(k))
        return tokenizer.apply_chat_template([{"role": "user", "content": body}])

    base = len(tokenizer.encode(render(0)))
    for k in range(max(0, num_tokens - base - 2), num_tokens - base + 3):
        text = render(k)
        ids = tokenizer.encode(text)
        if len(ids) == num_tokens:
            return text, ids
    raise RuntimeError(f"could not build a chat prompt of exactly {num_tokens} tokens")


def interleave(fns: dict[str, Callable[[], object]], rounds: int) -> dict[str, list]:
    """Call each fn once per round, rotating who goes first, so slow spells of a shared machine hit all."""
    names = list(fns)
    out: dict[str, list] = {n: [] for n in names}
    for r in range(rounds):
        for n in names[r % len(names):] + names[:r % len(names)]:
            out[n].append(fns[n]())
    return out


def base_parser(prog: str, doc: str, sections: tuple[str, ...]) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small sizes, for a CI smoke run (< 2 min)")
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    p.add_argument("--only", nargs="+", choices=sections, metavar="NAME",
                   help=f"run only these sections: {', '.join(sections)}")
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads (default 2)")
    return p


def quiet_hf() -> None:
    import transformers
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


# ----------------------------------------------------------------------------- the two systems

class Ours:
    name = "handoff"

    def __init__(self, dtype: str, num_blocks: int):
        from common.models import resolve_model_path
        from common.runner import ModelRunner
        from common.tokenizer import load_tokenizer

        self.runner = ModelRunner.load(MODEL, dtype=dtype, num_blocks=num_blocks, progress=False)
        self.model = self.runner.model
        self.tokenizer = load_tokenizer(resolve_model_path(MODEL))

    def prefill_s(self, ids: list[int]) -> float:
        from common.runner import PrefillItem

        pool = self.runner.cache.pool
        pool.allocate("prefill", len(ids) + 1)
        try:
            t0 = time.perf_counter()
            self.runner.prefill([PrefillItem("prefill", ids)])
            return time.perf_counter() - t0
        finally:
            pool.free("prefill")


class HF:
    name = PEER

    def __init__(self, dtype: str):
        from transformers import AutoModelForCausalLM, GgufConfig

        from common.models import resolve_model_path
        from common.runner import parse_dtype

        quiet_hf()
        p = resolve_model_path(MODEL)
        self.model = AutoModelForCausalLM.from_pretrained(
            str(p.parent), gguf_file=p.name, dtype=parse_dtype(dtype),
            quantization_config=GgufConfig(dequantize=True)).eval()

    @torch.inference_mode()
    def prefill_s(self, ids: list[int]) -> float:
        x = torch.tensor([ids])
        t0 = time.perf_counter()
        # logits_to_keep=1: only the last position's logits, as generate() asks for in a prefill.
        self.model(input_ids=x, use_cache=True, logits_to_keep=1)
        return time.perf_counter() - t0


# ----------------------------------------------------------------------------- decode loops, one per system

class EngineDecode:
    """Ours as serving runs it: Engine.step() driven synchronously (scheduling, sampling, detokenising)."""

    name = "engine"

    def __init__(self, ours: Ours, prompt_ids: list[int], bsz: int, max_tokens: int):
        from common.engine import Engine, EngineConfig
        from common.sampling import SamplingParams

        self.engine = Engine(ours.runner, ours.tokenizer, EngineConfig(max_running=max(64, bsz)))
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
        if len({len(t) for t in self.tokens}) != 1 or len(self.engine.running) != self.bsz:
            raise RuntimeError("engine decode: the batch shrank during the measurement (a sequence finished)")
        for i in range(self.bsz):
            self.engine.cancel(f"engine-{i}")
        self.engine.step()
        self.engine.check_integrity()


class RunnerDecode:
    """Ours without the engine: ModelRunner.decode and the greedy Sampler, nothing else per step."""

    name = "runner"

    def __init__(self, ours: Ours, prompt_ids: list[int], bsz: int, max_tokens: int):
        from common.runner import PrefillItem
        from common.sampling import Sampler, SamplingParams

        self.runner = ours.runner
        self.sampler = Sampler()
        self.greedy = SamplingParams(temperature=0.0)
        self.seq_ids = [f"runner-{i}" for i in range(bsz)]
        for s in self.seq_ids:
            self.runner.cache.pool.allocate(s, len(prompt_ids) + max_tokens + 1)
        self.next = self._sample(self.runner.prefill([PrefillItem(s, prompt_ids) for s in self.seq_ids]))
        self.pos = len(prompt_ids)

    def _sample(self, logits: torch.Tensor) -> list[int]:
        b = logits.shape[0]
        return self.sampler(logits, [self.greedy] * b, [0] * b, [0] * b, [()] * b, [()] * b).tolist()

    def steps(self, n: int) -> list[float]:
        from common.runner import DecodeItem

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


class HFDecode:
    """HF's manual decode loop: B copies of the same prompt (so no padding), its DynamicCache, argmax."""

    name = PEER

    @torch.inference_mode()
    def __init__(self, hf: HF, prompt_ids: list[int], bsz: int, max_tokens: int):
        self.model = hf.model
        out = self.model(input_ids=torch.tensor([prompt_ids] * bsz), use_cache=True, logits_to_keep=1)
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

def bench_bandwidth(quick: bool) -> float:
    from common.bandwidth import read_bandwidth_gbs

    gbs = read_bandwidth_gbs(num_bytes=(256 << 20) if quick else (1 << 30), repeats=4 if quick else 8)
    emit("memory_read_bandwidth", gbs, "GB/s (best of N, torch row-sum over fp32)")
    return gbs


def bench_prefill(ours: Ours, hf: HF, sizes: list[int], rounds: int) -> None:
    for n in sizes:
        _, ids = chat_prompt(ours.tokenizer, n)
        ours.prefill_s(ids), hf.prefill_s(ids)  # warm-up: the first call of a shape picks kernels
        t = interleave({"ours": partial(ours.prefill_s, ids), "hf": partial(hf.prefill_s, ids)}, rounds)
        v, pv = n / statistics.median(t["ours"]), n / statistics.median(t["hf"])
        log(f"prefill {n}: ours {v:.0f} tok/s, HF {pv:.0f} tok/s")
        emit(f"prefill_tok_s_{n}", v, "tok/s", peer=hf.name, peer_value=pv, target="ratio >= 1.0",
             met=v / pv >= 1.0, prompt_len=n, rounds=rounds)


def bench_decode(ours: Ours, hf: HF, batches: list[int], steps: int, warmup: int, rounds: int,
                 bandwidth_gbs: float, dtype: str) -> None:
    from common.bandwidth import decode_bound_tok_s

    _, prompt_ids = chat_prompt(ours.tokenizer, CHAT_PROMPT_LEN)
    per_round = -(-steps // rounds)
    max_tokens = warmup + per_round * rounds + 8  # nobody finishes while measured
    targets = {1: 2.0, 32: 1.5}
    for bsz in batches:
        log(f"decode {bsz} seq: prefilling {bsz} x {CHAT_PROMPT_LEN} tokens in each system")
        loops = [EngineDecode(ours, prompt_ids, bsz, max_tokens), RunnerDecode(ours, prompt_ids, bsz, max_tokens),
                 HFDecode(hf, prompt_ids, bsz, max_tokens)]
        for loop in loops:
            loop.steps(warmup)
        times = interleave({loop.name: partial(loop.steps, per_round) for loop in loops}, rounds)
        tok_s = {name: bsz / statistics.median([s for r in rs for s in r]) for name, rs in times.items()}
        log(f"decode {bsz} seq: engine {tok_s['engine']:.1f}, runner {tok_s['runner']:.1f}, "
            f"HF {tok_s[PEER]:.1f} tok/s")
        goal = targets.get(bsz)
        kw = dict(target=f"ratio >= {goal}", met=tok_s["engine"] / tok_s[PEER] >= goal) if goal else {}
        emit(f"decode_tok_s_{bsz}seq", tok_s["engine"], "tok/s (Engine.step, median step)", peer=PEER,
             peer_value=tok_s[PEER], batch=bsz, context_len=CHAT_PROMPT_LEN, steps=per_round * rounds, **kw)
        emit(f"decode_runner_tok_s_{bsz}seq", tok_s["runner"], "tok/s (ModelRunner.decode + Sampler, median step)",
             peer=PEER, peer_value=tok_s[PEER], batch=bsz)
        if bsz == 1:
            engine_ids, hf_ids = loops[0].tokens[0], loops[2].tokens
            n = min(len(engine_ids), len(hf_ids))
            same = next((i for i in range(n) if engine_ids[i] != hf_ids[i]), n)
            emit("decode_greedy_prefix_match", same, f"tokens of {n} equal to HF's greedy output")
            model = ours.model
            use_int4 = model.has_int4 and bsz <= ours.runner.int4_max_batch
            dense_bytes = model.decode_weight_bytes(use_int4=False)
            for label, nbytes in ((dtype, dense_bytes),
                                  ("read", model.decode_weight_bytes(use_int4=True) if use_int4 else dense_bytes)):
                bound = decode_bound_tok_s(bandwidth_gbs, nbytes)
                what = ("every weight dense" if label == dtype else
                        "what the runner reads at batch 1" + (" (int4 packed + lm_head)" if use_int4 else ""))
                emit(f"decode_1seq_bound_{label}_weights", bound, f"tok/s ({nbytes / 1e6:.1f} MB per step, {what})",
                     weight_bytes=nbytes)
                frac = tok_s["engine"] / bound
                emit(f"decode_1seq_fraction_of_bound_{label}", frac, "fraction (engine tok/s / bound)",
                     target=">= 0.6", met=frac >= 0.6)
        for loop in reversed(loops):  # the runner's blocks first: the engine checks its pool is all its own
            loop.close()
        del loops
        gc.collect()


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
    return {who: subprocess.Popen([sys.executable, "-m", "common.bench", "--memory-probe", who, "--dtype", dtype,
                                   "--threads", str(threads)], stdout=subprocess.PIPE, text=True)
            for who in ("ours", "hf")}


def memory_probe(who: str, dtype: str) -> None:
    import psutil

    prompt_len, steps = 512, 32
    if who == "ours":
        from common.runner import DecodeItem, PrefillItem
        ours = Ours(dtype, num_blocks=-(-(prompt_len + steps + 1) // 16))
        _, ids = chat_prompt(ours.tokenizer, prompt_len)
        ours.runner.cache.pool.allocate("m", prompt_len + steps + 1)
        tok = int(ours.runner.prefill([PrefillItem("m", ids)]).argmax(-1))
        for i in range(steps):
            tok = int(ours.runner.decode([DecodeItem("m", tok, prompt_len + i)]).argmax(-1))
    else:
        from common.models import resolve_model_path
        from common.tokenizer import load_tokenizer
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


# ----------------------------------------------------------------------------- main

def main(argv: list[str] | None = None) -> None:
    p = base_parser("python -m common.bench", __doc__, SECTIONS)
    p.add_argument("--profile", action="store_true", help="profile one decode step at batch 1 and 32 (stderr)")
    p.add_argument("--memory-probe", choices=("ours", "hf"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.memory_probe:
        return memory_probe(args.memory_probe, args.dtype)
    if args.profile:
        return profile_decode(args.dtype)
    sections = set(args.only or SECTIONS)
    q = args.quick
    prefill_sizes = [128] if q else [128, 512, 2048]
    batches = [1, 8] if q else [1, 8, 32]
    steps, warmup, rounds = (16, 4, 2) if q else (64, 8, 4)
    t_start = time.perf_counter()
    log(f"dtype {args.dtype}, {args.threads} threads, sections {sorted(sections)}{' (quick)' if q else ''}")

    probes = start_memory_probes(args.dtype, args.threads) if "memory" in sections else {}
    ours = hf = None
    if sections & {"prefill", "decode"}:
        log("loading ours and HF (the memory probes load in parallel)")
        max_tokens = warmup + steps + 16
        num_blocks = max(2048 // 16 + 1, 2 * max(batches) * -(-(CHAT_PROMPT_LEN + max_tokens) // 16))
        ours, hf = Ours(args.dtype, num_blocks), HF(args.dtype)
    if probes:
        log("waiting for the memory probes")
        bench_memory(probes)
    bandwidth = bench_bandwidth(q) if sections & {"bandwidth", "decode"} else None
    if "prefill" in sections:
        bench_prefill(ours, hf, prefill_sizes, rounds=2 if q else 3)
    if "decode" in sections:
        bench_decode(ours, hf, batches, steps, warmup, rounds, bandwidth, args.dtype)
    log(f"done in {time.perf_counter() - t_start:.0f} s")


if __name__ == "__main__":
    main()
