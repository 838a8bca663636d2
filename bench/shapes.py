"""python -m bench.shapes: the engine at the sizes people serve, against llama.cpp on the same GGUF file.

    python -m bench.shapes                                   # 1B, 3B and 8B shapes, Q4_K_M and Q8_0 (an hour or more)
    python -m bench.shapes --shapes llama-3.2-1b --qtypes Q4_K_M --only decode
    python -m bench.shapes --quick                           # the 1B Q4_K_M file, few samples (a few minutes)

The files are random-weight GGUFs of Llama 3.2 1B, Qwen 2.5 3B and Llama 3.1 8B (bench/zoo/big.py: built
once with llama.cpp's own converter and quantizer, cached outside the repository; `make zoo` has the
command). Random weights change no timing: every step reads every byte and does every multiply.

What is measured, ours against llama.cpp (llama-cpp-python, `make bench-peers`) on the same file, the same
token ids, the same thread count, the same warm-up, turns taken in rotation in one process:
- decode tok/s at 1, 8 and 32 streams: ours loaded as a disaggregated decode worker loads it (the file's
  packed matrices, no dense copies: `--dense-weights lazy`), ModelRunner.decode plus a greedy pick each
  step; llama.cpp's batched API (one llama_decode of one token per stream, `n_seq_max` streams in one
  unified KV cache, greedy argmax of each). Every stream's context is one 128-token prompt, prefilled once
  and its K/V copied to the others (llama_memory_seq_cp; ours: the cache's rows), the same for both. At one
  stream a pass of the read-bandwidth probe (bench/bandwidth.py) takes its turn too, and the step's
  bytes (packed weights, K/V) over its median time, against the probe's median, is the bandwidth fraction.
- prefill tok/s at 512 and 2,048 tokens: ours loaded as a prefill worker loads it (dense copies in the
  dtype, the prompt in chunks of 256 at fixed positions, as the worker runs it); llama.cpp at its defaults
  (n_batch 2048, n_ubatch 512, flash attention auto). Where both would not fit in memory (8B: 16 GB of
  bf16 beside the file), each runs alone in its own process, llama.cpp first, same samples and warm-up.
- with --lazy-prefill, prefill also as a decode worker under `--dense-weights lazy` does it (each layer's
  dense matrices made from the file as the prompt reaches them), against the kept copies.
- the peak RSS of a decode worker: a fresh process per system loads the file as above, takes a 128-token
  context's K/V (ours: written into its pool as a push writes it; llama.cpp: its prompt evaluated) and
  decodes 32 tokens; getrusage's high-water mark, with each side's KV cache (sized for 256 tokens) subtracted.

Every section of every file runs in a fresh process (the parent only starts them and passes their lines
on), so no section inherits another's memory. Figures are JSON lines ({"name", "value", "unit", "peer",
"peer_value", "ratio", ...}): medians, with the interquartile range, the sample count and each round's
ratio range. lscpu's flags, the load average before and after, and the thread count come first.
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

from common import cli, settings
from bench import llamacpp
from bench.engine import RunnerDecode
from bench.harness import emit, emit_load_avg, emit_machine, emit_skipped, interleave, log, percentile

SHAPES = ("llama-3.2-1b", "qwen2.5-3b", "llama-3.1-8b")
QTYPES = ("Q4_K_M", "Q8_0")
CONTEXT = 128  # every decode stream's context: one prompt of this many tokens
PREFILL_CHUNK = 256  # the workers' default --prefill-chunk-tokens
RSS_CTX = 256  # the KV cache each side sizes for the memory probe
RSS_STEPS = 32


def prompt_ids(n: int, vocab: int, seed: int = 0) -> list[int]:
    """n token ids, the same for both systems: random ordinary tokens (ids past the first 1000, below the
    special tokens that close a large vocabulary)."""
    rng = np.random.default_rng(seed)
    return rng.integers(1000, min(vocab, 32000), n).tolist()


# ----------------------------------------------------------------------------- ours

def load_ours(path: Path, role: str, dtype: str, blocks: int):
    """A ModelRunner over the file as a worker of `role` loads it (common/worker.py's _load_model)."""
    from common.engine.runner import ModelRunner

    decode = role == "decode"
    return ModelRunner.load(path, dtype=dtype, num_blocks=blocks, progress=False, packed_decode=decode,
                            keep_dense=not decode)


class OursStreams(RunnerDecode):
    """n streams on ours: the context prefilled once, its K/V copied to every stream, then decode steps of
    one token a stream, greedy (RunnerDecode's steps and close)."""

    name = "handoff"

    def __init__(self, runner, ids: list[int], n: int, max_steps: int):
        from common.engine.runner import PrefillItem

        self.runner = runner
        pool, cache = runner.cache.pool, runner.cache
        self.seq_ids = [f"s{i}" for i in range(n)]
        for s in self.seq_ids:
            pool.allocate(s, len(ids) + max_steps + 1)
        logits = runner.prefill([PrefillItem(self.seq_ids[0], ids)])
        src = torch.tensor(cache.slots(pool.block_table(self.seq_ids[0]), 0, len(ids)))
        for s in self.seq_ids[1:]:
            dst = torch.tensor(cache.slots(pool.block_table(s), 0, len(ids)))
            cache.kv[:, dst] = cache.kv[:, src]
        self.next = [int(logits[0].argmax())] * n
        self.pos = len(ids)

    def _sample(self, logits: torch.Tensor) -> list[int]:
        return logits.argmax(-1).tolist()


def ours_prefill_s(runner, ids: list[int]) -> float:
    """One prompt through ModelRunner.prefill in the workers' chunks, as a prefill worker runs it."""
    from common.engine.runner import PrefillItem

    pool = runner.cache.pool
    pool.allocate("p", len(ids) + 1)
    try:
        t0 = time.perf_counter()
        for start in range(0, len(ids), PREFILL_CHUNK):
            runner.prefill([PrefillItem("p", ids[start:start + PREFILL_CHUNK], start)])
        return time.perf_counter() - t0
    finally:
        pool.free("p")


# ----------------------------------------------------------------------------- llama.cpp

_LOG_SINK = None


def _quiet(lc) -> None:
    """llama.cpp's log lines (several hundred a model load) off stderr, where the progress goes."""
    global _LOG_SINK
    if _LOG_SINK is None:
        _LOG_SINK = lc.llama_log_callback(lambda level, text, user_data: None)
        lc.llama_log_set(_LOG_SINK, ctypes.c_void_p(0))


class LlamaCppBatched:
    """llama.cpp through its C API (llama-cpp-python's bindings): one model, one context of up to
    `n_seq_max` streams in a unified KV cache, at llama.cpp's defaults otherwise (mmap'd weights, n_batch
    2048, n_ubatch 512, flash attention auto, f16 K/V)."""

    name = llamacpp.NAME

    def __init__(self, path: Path, threads: int, n_ctx: int, n_seq_max: int = 1):
        import llama_cpp as lc

        self.lc = lc
        _quiet(lc)
        lc.llama_backend_init()
        self.model = lc.llama_model_load_from_file(str(path).encode(), lc.llama_model_default_params())
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        params = lc.llama_context_default_params()
        params.n_ctx = n_ctx
        params.n_seq_max = n_seq_max
        params.n_threads = params.n_threads_batch = threads
        params.kv_unified = True  # streams copied from one prompt share its cells
        self.ctx = lc.llama_init_from_model(self.model, params)
        if not self.ctx:
            raise RuntimeError(f"llama.cpp could not make a context of {n_ctx} tokens, {n_seq_max} streams")
        self.n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.model))
        self.n_batch = params.n_batch
        self.batch = lc.llama_batch_init(self.n_batch, 0, 1)

    def _decode(self, tokens: list[int], positions: list[int], seqs: list[int], outputs: list[bool]) -> None:
        b = self.batch
        b.n_tokens = len(tokens)
        for i, (t, p, s, o) in enumerate(zip(tokens, positions, seqs, outputs)):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = t, p, 1, o
            b.seq_id[i][0] = s
        rc = self.lc.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")

    def clear(self) -> None:
        self.lc.llama_memory_clear(self.lc.llama_get_memory(self.ctx), True)

    def prefill(self, ids: list[int], seq: int = 0) -> int:
        """The prompt into stream `seq`, in batches of n_batch; the greedy next token."""
        for start in range(0, len(ids), self.n_batch):
            part = ids[start:start + self.n_batch]
            last = start + len(part) == len(ids)
            self._decode(part, list(range(start, start + len(part))), [seq] * len(part),
                         [last and i == len(part) - 1 for i in range(len(part))])
        return self.argmax(-1)

    def prefill_s(self, ids: list[int]) -> float:
        self.clear()
        t0 = time.perf_counter()
        self.prefill(ids)
        return time.perf_counter() - t0

    def argmax(self, i: int) -> int:
        row = np.ctypeslib.as_array(self.lc.llama_get_logits_ith(self.ctx, i), shape=(self.n_vocab,))
        return int(row.argmax())

    def close(self) -> None:
        self.lc.llama_batch_free(self.batch)
        self.lc.llama_free(self.ctx)
        self.lc.llama_model_free(self.model)


class LlamaCppStreams:
    """n streams on llama.cpp: the context evaluated once into stream 0 and copied (llama_memory_seq_cp)
    to the others, then llama_decode of one token a stream per step, greedy."""

    name = llamacpp.NAME

    def __init__(self, peer: LlamaCppBatched, ids: list[int], n: int):
        lc = peer.lc
        self.peer, self.n = peer, n
        peer.clear()
        first = peer.prefill(ids)
        mem = lc.llama_get_memory(peer.ctx)
        for s in range(1, n):
            lc.llama_memory_seq_cp(mem, 0, s, -1, -1)
        self.next = [first] * n
        self.pos = len(ids)

    def steps(self, k: int) -> list[float]:
        out = []
        for _ in range(k):
            t0 = time.perf_counter()
            self.peer._decode(self.next, [self.pos] * self.n, list(range(self.n)), [True] * self.n)
            self.next = [self.peer.argmax(i) for i in range(self.n)]
            self.pos += 1
            out.append(time.perf_counter() - t0)
        return out

    def close(self) -> None:
        self.peer.clear()


# ----------------------------------------------------------------------------- figures

def spread(xs: list[float]) -> dict:
    return {"p25": round(percentile(xs, 25), 4), "p75": round(percentile(xs, 75), 4), "n": len(xs)}


def emit_pair(name: str, unit: str, ours: list[float], peer: list[float], per_round: list[float], **extra) -> None:
    """Rates (higher is better) of ours and llama.cpp: medians, their spreads and each round's ratio."""
    a, b = statistics.median(ours), statistics.median(peer)
    emit(name, a, unit, peer=llamacpp.NAME, peer_value=b, ours_spread=spread(ours), peer_spread=spread(peer),
         round_ratio_min=round(min(per_round), 3), round_ratio_max=round(max(per_round), 3), **extra)


def section_decode(path: Path, args) -> None:
    from bench.bandwidth import ReadBandwidth
    from common.engine.runner import DecodeItem  # noqa: F401  (fails early where the engine cannot import)

    streams = sorted(args.streams)
    steps, rounds = args.steps, args.rounds
    # every step a stream takes: warm-up, the timed turns, and ours' untimed step after each bandwidth pass
    most = (2 * rounds + 3) * steps + 16
    blocks = max(streams) * -(-(CONTEXT + most + 1) // 16) + 8
    runner = load_ours(path, "decode", args.dtype, blocks)
    model = runner.model
    ids = prompt_ids(CONTEXT, model.config.vocab_size)
    peer = LlamaCppBatched(path, args.threads, max(streams) * (CONTEXT + most + 16), max(streams))
    bandwidth = ReadBandwidth(1 << 30)
    weight_bytes = model.decode_weight_bytes(True)
    kv_token = runner.cache.kv[:, :1].numel() * runner.cache.kv.element_size()  # every layer's K and V
    emit("decode_weight_bytes", weight_bytes / 1e6, "MB a step reads of packed weights (ours)",
         file=path.name, dtype=str(model.dtype))
    for n in streams:
        loops = {"handoff": OursStreams(runner, ids, n, most),
                 "llama.cpp": LlamaCppStreams(peer, ids, n)}
        if n == 1:
            loops["bandwidth"] = _Passes(bandwidth, loops["handoff"])
        for loop in loops.values():  # the same warm-up for every system
            loop.steps(max(2, steps // 2))
        got = interleave({k: (lambda v=v: statistics.median(v.steps(steps))) for k, v in loops.items()}, rounds)
        ours = [n / s for s in got["handoff"]]
        theirs = [n / s for s in got["llama.cpp"]]
        emit_pair(f"decode_tok_s_{n}_streams", "tok/s (higher is better)", ours, theirs,
                  [a / b for a, b in zip(ours, theirs)], file=path.name, streams=n, context=CONTEXT,
                  steps_per_round=steps, rounds=rounds)
        if n == 1:
            gbs = [(1 << 30) / s / 1e9 for s in got["bandwidth"]]
            step_bytes = weight_bytes + kv_token * (CONTEXT + steps)
            best = max(gbs)
            ours_gbs = step_bytes / statistics.median(got["handoff"]) / 1e9
            peer_gbs = step_bytes / statistics.median(got["llama.cpp"]) / 1e9
            emit("decode_1_stream_bandwidth_fraction", ours_gbs / best,
                 "of the best read pass (the step's bytes / its median time)", peer=llamacpp.NAME,
                 peer_value=peer_gbs / best, target=">= 0.7", met=ours_gbs / best >= 0.7,
                 in_turn_fraction=ours_gbs / statistics.median(gbs), best_read_gbs=best,
                 median_read_gbs=statistics.median(gbs), read_gbs_spread=spread(gbs),
                 step_mb=round(step_bytes / 1e6, 1), file=path.name)
        for loop in loops.values():
            loop.close()
    peer.close()


class _Passes:
    """The bandwidth probe's pass as a loop in the rotation, followed by one untimed step of ours (so the
    step timed after it follows a decode step, as in service: bench.engine.BandwidthPasses)."""

    def __init__(self, bandwidth, ours: OursStreams):
        self.bandwidth, self.ours = bandwidth, ours

    def steps(self, k: int) -> list[float]:
        out = []
        for _ in range(k):
            out.append(self.bandwidth.one_pass())
            self.ours.steps(1)
        return out

    def close(self) -> None:
        pass


def section_prefill(path: Path, args, alone: str | None) -> None:
    """Both systems in turn, or (alone) one of them, at each prompt length."""
    lengths = sorted(args.prefill)
    who = ("handoff", "llama.cpp") if alone is None else (alone,)
    systems = {}
    vocab = None
    if "handoff" in who:
        runner = load_ours(path, "prefill", args.dtype, -(-(max(lengths) + 1) // 16) + 1)
        vocab = runner.model.config.vocab_size
        systems["handoff"] = lambda ids: ours_prefill_s(runner, ids)
    if "llama.cpp" in who:
        peer = LlamaCppBatched(path, args.threads, max(lengths) + 16)
        vocab = vocab or peer.n_vocab
        systems["llama.cpp"] = peer.prefill_s
    if alone is None and args.lazy_prefill:  # a decode worker's own prefill, dense copies made from the file
        lazy = load_ours(path, "decode", args.dtype, -(-(max(lengths) + 1) // 16) + 1)
        systems["handoff-lazy"] = lambda ids: ours_prefill_s(lazy, ids)
    for n in lengths:
        ids = prompt_ids(n, vocab, seed=n)
        for fn in systems.values():  # the same warm-up for every system: one prompt of this length
            fn(ids)
        rounds = args.prefill_rounds
        got = interleave({k: (lambda f=f: n / f(ids)) for k, f in systems.items()}, rounds)
        if alone is None:
            emit_pair(f"prefill_tok_s_{n}", "tok/s (higher is better)", got["handoff"], got["llama.cpp"],
                      [a / b for a, b in zip(got["handoff"], got["llama.cpp"])], file=path.name, tokens=n,
                      rounds=rounds, dtype=args.dtype)
            if "handoff-lazy" in got:
                emit(f"prefill_tok_s_{n}_dense_lazy", statistics.median(got["handoff-lazy"]),
                     "tok/s (higher is better; ratio = lazy / kept)", peer="handoff, dense copies kept",
                     peer_value=statistics.median(got["handoff"]), ours_spread=spread(got["handoff-lazy"]),
                     file=path.name, tokens=n, what="a decode worker's prefill under --dense-weights lazy: "
                     "each layer's dense matrices made from the file as the prompt reaches them")
        else:
            print(json.dumps({"alone": alone, "tokens": n, "tok_s": got[alone]}), flush=True)


def section_rss(path: Path, args, who: str) -> None:
    """A decode worker's memory: load, a context's K/V, 32 steps; one line of figures."""
    if who == "handoff":
        runner = load_ours(path, "decode", args.dtype, -(-RSS_CTX // 16))
        ids = prompt_ids(CONTEXT, runner.model.config.vocab_size)
        pool, cache = runner.cache.pool, runner.cache
        pool.allocate("r", RSS_CTX)
        # the context's K/V as a push writes it (a disaggregated decode worker never prefills it itself)
        layers, _, _, heads, dim = cache.kv.shape
        kv = torch.randn((layers, 2, CONTEXT, heads, dim), generator=torch.Generator().manual_seed(0))
        cache.import_seq("r", (kv * 0.1).to(cache.kv.dtype))
        del kv
        loop = OursStreams.__new__(OursStreams)  # the context's K/V is there: no prefill
        loop.runner, loop.seq_ids, loop.next, loop.pos = runner, ["r"], [ids[-1]], CONTEXT
        loop.steps(RSS_STEPS)
        kv_bytes = cache.kv_bytes
        weights = runner.model.weight_bytes()
    else:
        peer = LlamaCppBatched(path, args.threads, RSS_CTX)
        ids = prompt_ids(CONTEXT, peer.n_vocab)
        loop = LlamaCppStreams(peer, ids, 1)
        loop.steps(RSS_STEPS)
        c = _gguf_dims(path)
        kv_bytes = c["layers"] * 2 * c["kv_heads"] * c["head_dim"] * 2 * RSS_CTX  # f16 K and V, every layer
        weights = path.stat().st_size
    gc.collect()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"who": who, "peak_rss": peak, "kv_bytes": kv_bytes, "weight_bytes": weights}), flush=True)


def _gguf_dims(path: Path) -> dict:
    from common.engine.gguf_weights import read_config

    c = read_config(path)
    return {"layers": c.num_layers, "kv_heads": c.num_kv_heads, "head_dim": c.head_dim}


# ----------------------------------------------------------------------------- the parent

def run_child(args, section: str, path: Path, extra: list[str] = ()) -> list[dict]:
    """One section in a fresh process; its JSON lines are passed on (and returned)."""
    cmd = [sys.executable, "-m", "bench.shapes", "--child", section, str(path), "--threads", str(args.threads),
           "--dtype", args.dtype, "--rounds", str(args.rounds), "--steps", str(args.steps),
           "--prefill-rounds", str(args.prefill_rounds), "--streams", *map(str, args.streams),
           "--prefill", *map(str, args.prefill), *(["--lazy-prefill"] if args.lazy_prefill else []), *extra]
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run(cmd, cwd=root, stdout=subprocess.PIPE, text=True, timeout=args.child_timeout_s)
    if proc.returncode != 0:
        raise RuntimeError(f"{section} on {path.name} failed (exit {proc.returncode}); its stderr is above")
    lines = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
    for x in lines:
        if "alone" not in x and "who" not in x:
            print(json.dumps(x), flush=True)
    return lines


def fits_together(path: Path, shape: str) -> bool:
    """Whether a prefill worker's dense bf16 copies and llama.cpp's mapped file fit in memory at once."""
    from bench.zoo.big import big_dir

    spec = json.loads((big_dir(shape) / f"{shape}.json").read_text())
    dense = spec["f16"]["params"] * 2
    with open("/proc/meminfo") as f:
        total = int(next(line for line in f if line.startswith("MemTotal")).split()[1]) * 1024
    return dense + path.stat().st_size + (3 << 30) < 0.9 * total


def prefill_alone(args, path: Path) -> None:
    """Each system alone in its own process (llama.cpp first), then the figures from their samples."""
    got = {}
    for who in ("llama.cpp", "handoff"):
        for line in run_child(args, "prefill", path, ["--alone", who]):
            got.setdefault(line["tokens"], {})[who] = line["tok_s"]
    for n, both in sorted(got.items()):
        emit_pair(f"prefill_tok_s_{n}", "tok/s (higher is better)", both["handoff"], both["llama.cpp"],
                  [a / b for a, b in zip(both["handoff"], both["llama.cpp"])], file=path.name, tokens=n,
                  rounds=args.prefill_rounds, dtype=args.dtype,
                  note="each system alone in its own process, one after the other (both do not fit in memory)")


def rss(args, path: Path) -> None:
    got = {}
    for who in ("llama.cpp", "handoff"):
        got[who] = run_child(args, "rss", path, ["--who", who])[-1]
    mib = 1 << 20
    ours, peer = (got[w]["peak_rss"] - got[w]["kv_bytes"] for w in ("handoff", "llama.cpp"))
    emit("decode_worker_peak_rss_mib", ours / mib, "MiB, KV cache excluded (lower is better; ratio = ours / peer)",
         peer=llamacpp.NAME, peer_value=peer / mib, file=path.name, file_mib=round(path.stat().st_size / mib),
         ours_weights_mib=round(got["handoff"]["weight_bytes"] / mib), kv_mib={w: round(got[w]["kv_bytes"] / mib, 1) for w in got},
         what=f"getrusage high-water mark of a fresh process: load as a decode worker, a {CONTEXT}-token "
              f"context's K/V, {RSS_STEPS} decode steps")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.shapes", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=SHAPES)
    p.add_argument("--qtypes", nargs="+", default=list(QTYPES), choices=QTYPES)
    p.add_argument("--only", nargs="+", default=["decode", "prefill", "rss"], choices=("decode", "prefill", "rss"))
    p.add_argument("--threads", type=int, default=2, help="threads for both systems (default 2)")
    p.add_argument("--dtype", default=settings.default("dtype"), choices=settings.DTYPES)
    p.add_argument("--streams", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--prefill", type=int, nargs="+", default=[512, 2048])
    p.add_argument("--steps", type=int, default=8, help="decode steps a turn (default 8)")
    p.add_argument("--rounds", type=int, default=5, help="decode turns each system takes (default 5)")
    p.add_argument("--prefill-rounds", type=int, default=3, help="prompts each system runs a length (default 3)")
    cli.add_switch(p, "--lazy-prefill", "also prefill as a decode worker under --dense-weights lazy (where both fit in memory)")
    p.add_argument("--child-timeout-s", type=float, default=3600)
    cli.add_switch(p, "--quick", "the 1B Q4_K_M file, few samples")
    p.add_argument("--child", nargs=2, metavar=("SECTION", "FILE"), help=argparse.SUPPRESS)
    p.add_argument("--alone", choices=("handoff", "llama.cpp"), help=argparse.SUPPRESS)
    p.add_argument("--who", choices=("handoff", "llama.cpp"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.child:
        section, path = args.child[0], Path(args.child[1])
        if section == "decode":
            section_decode(path, args)
        elif section == "prefill":
            section_prefill(path, args, args.alone)
        else:
            section_rss(path, args, args.who)
        return
    if args.quick:
        args.shapes, args.qtypes = ["llama-3.2-1b"], ["Q4_K_M"]
        args.streams, args.prefill, args.steps, args.rounds, args.prefill_rounds = [1, 8], [512], 4, 3, 2
    why = llamacpp.missing_reason()
    if why is not None:
        emit_skipped("shapes", why, llamacpp.HOW_TO_GET)
        return
    from bench.zoo.big import big

    emit_machine(threads=args.threads, dtype=args.dtype)
    emit_load_avg("start")
    for shape in args.shapes:
        for qtype in args.qtypes:
            path = big(shape, qtype)  # built once and cached (minutes for 8B)
            log(f"{path.name}: {', '.join(args.only)}")
            if "decode" in args.only:
                run_child(args, "decode", path)
            if "prefill" in args.only:
                if fits_together(path, shape):
                    run_child(args, "prefill", path)
                else:
                    prefill_alone(args, path)
            if "rss" in args.only:
                rss(args, path)
            emit_load_avg(f"end_of_{path.stem}")


if __name__ == "__main__":
    main()
