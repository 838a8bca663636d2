"""What every benchmark here shares: its output (one JSON line per figure on stdout, progress on stderr),
taking turns on a shared machine, percentiles, the chat prompts it measures with, and its command line."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable

from common import cli, settings

MODEL = "smollm2"


# ----------------------------------------------------------------------------- output

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


def emit_skipped(name: str, why: str, how: str, **extra) -> dict:
    """Print, as a JSON line, figures this run could not measure and how to get them; say so on stderr too."""
    rec = {"name": name, "skipped": why, "how": how, **extra}
    print(json.dumps(rec), flush=True)
    log(f"{name} skipped: {why}; {how}")
    return rec


def emit_machine(**fields) -> None:
    """The run's first line: the CPU's flags (what the kernels can use) and the benchmark's own settings."""
    from common.engine.hardware import reported_flags

    print(json.dumps({"name": "machine", "cpu_flags": reported_flags(), **fields}), flush=True)


def emit_load_avg(when: str) -> dict:
    """The load average at the run's `when` ("start", "end"): other processes on the machine are noise."""
    return emit(f"load_avg_1min_at_{when}", os.getloadavg()[0], f"runnable processes ({os.cpu_count()} cores): noise")


# ----------------------------------------------------------------------------- measuring

def percentile(xs: list[float], q: float) -> float:
    """Linear-interpolated q-th percentile (numpy's default); with n samples p99 is near the max."""
    s = sorted(xs)
    k = (len(s) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def interleave(fns: dict[str, Callable[[], object]], rounds: int) -> dict[str, list]:
    """Call each fn once per round, rotating who goes first, so slow spells of a shared machine hit all.
    Who follows whom stays fixed (a shuffled order was tried: a step that came right after llama.cpp's ran
    beside its threads still spinning, and every figure of ours dropped; docs/benchmarks.md, "Figures
    behind the code": A fixed order of turns); the bandwidth pass, which evicts every cache, is followed by
    an untimed step of ours (bench.engine.BandwidthPasses.settle)."""
    names = list(fns)
    out: dict[str, list] = {n: [] for n in names}
    for r in range(rounds):
        for n in names[r % len(names):] + names[:r % len(names)]:
            out[n].append(fns[n]())
    return out


# ----------------------------------------------------------------------------- prompts

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


def system_prompt(tokenizer, topic: str, num_tokens: int) -> str:
    """A system prompt of about num_tokens tokens (at least), about `topic`."""
    sentence = (f"You are the assistant of a public library and you answer questions about {topic}: you are "
                f"brief, exact, and you say when you do not know. ")
    text = ""
    while len(tokenizer.encode(text)) < num_tokens:
        text += sentence
    return text


# ----------------------------------------------------------------------------- command line

def base_parser(prog: str, doc: str, sections: tuple[str, ...], *, threads: int = 2,
                threads_help: str = "torch intra-op threads (default 2)") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    cli.add_switch(p, "--quick", "small sizes, for a CI smoke run (< 2 min)")
    p.add_argument("--dtype", default=settings.default("dtype"), choices=settings.DTYPES,
                   help="auto (the default of every service): bf16 where the CPU multiplies it natively, else fp32")
    p.add_argument("--only", nargs="+", choices=sections, metavar="NAME",
                   help=f"run only these sections: {', '.join(sections)}")
    p.add_argument("--threads", type=int, default=threads, help=threads_help)
    return p
