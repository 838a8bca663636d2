"""Structured outputs: what a constraint costs per token.

1. The grammar engines alone, llguidance (what handoff uses) against xgrammar, on SmolLM2's vocabulary: for the
   tokens of valid documents of a few schemas, the time to compute the next-token bitmask and to advance the
   matcher by the token, per token, the engines' turns rotated; and each constraint's compile time.
2. The engine: a decode step of 1 and of 32 sequences, every sequence constrained (a JSON schema long enough that
   no sequence ends during the measured steps) against the same sequences unconstrained, in the same run, turns
   rotated; the overhead per step and per token.

    python -m bench.grammar                 # both parts; part 1 skips xgrammar where it is not installed
    python -m bench.grammar --only engines  # part 1 (--only engine: part 2)

xgrammar is not a dependency (it needs transformers and triton at run time): install it beside, e.g. into a venv
whose .pth file points at this one's site-packages, and run this file with that venv's python. One JSON line per
figure, the first with the CPU's flags.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import json
import statistics
import time

import torch

from bench.harness import emit, emit_load_avg, emit_machine, interleave, log, percentile

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 32},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150},
                                           "email": {"type": "string"}},
          "required": ["name", "age", "email"], "additionalProperties": False}
ORDER = {"type": "object", "properties": {
    "id": {"type": "integer"}, "status": {"type": "string", "enum": ["open", "paid", "shipped"]},
    "items": {"type": "array", "items": {"type": "object", "properties": {
        "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"}, "qty": {"type": "integer", "minimum": 1},
        "price": {"type": "number"}}, "required": ["sku", "qty", "price"], "additionalProperties": False}},
    "note": {"type": "string"}}, "required": ["id", "status", "items", "note"], "additionalProperties": False}
DOCS = {
    "person": (PERSON, {"name": "Ada Lovelace", "age": 36, "email": "ada@example.org"}),
    "order": (ORDER, {"id": 1042, "status": "paid", "items": [{"sku": "ABC-1234", "qty": 2, "price": 9.5},
                                                              {"sku": "XYZ-0001", "qty": 1, "price": 120.25}],
                      "note": "Leave the parcel at the door, please; the bell does not work."}),
}
# The engine part: 6 orders of 4 items each is ~300 tokens; no sequence ends within the measured steps.
LONG = {"type": "array", "items": ORDER, "minItems": 6, "maxItems": 6}


class LLGuidance:
    name = "llguidance"

    def __init__(self, tokenizer):
        from common.engine.grammar import GrammarCompiler
        self.compiler = GrammarCompiler(tokenizer)
        self.compiler.lltokenizer  # built before any timing
        self.vocab_size = tokenizer.vocab_size

    def compile_s(self, schema: dict) -> float:
        import llguidance

        from common.engine.grammar import _JSON_OPTIONS
        t0 = time.perf_counter()
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS)
        llguidance.LLMatcher(self.compiler.lltokenizer, grammar, log_level=0)
        return time.perf_counter() - t0

    def walk(self, schema: dict, ids: list[int]) -> list[float]:
        """Per token: the bitmask for the next token, then consuming it. Seconds."""
        from common.engine.grammar import Constraint, bitmask_words, fill_bitmask
        m = self.compiler.matcher(Constraint("json_schema", json.dumps(schema)))
        bitmask = torch.empty(1, bitmask_words(self.vocab_size), dtype=torch.int32)
        times = []
        for tok in ids:
            t0 = time.perf_counter()
            fill_bitmask([m], bitmask)
            assert (bitmask[0, tok // 32] >> (tok % 32)) & 1, "llguidance refused the document's token"
            m.consume_token(tok)
            times.append(time.perf_counter() - t0)
        return times


class XGrammar:
    name = "xgrammar"

    def __init__(self, tokenizer):
        import xgrammar as xgr
        self.xgr = xgr
        info = xgr.TokenizerInfo(tokenizer.token_bytes(), vocab_type=xgr.VocabType.RAW,
                                 vocab_size=tokenizer.vocab_size, stop_token_ids=sorted(tokenizer.stop_ids))
        self.compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.vocab_size = tokenizer.vocab_size

    def _compile(self, schema: dict):
        return self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(", ", ": "))

    def compile_s(self, schema: dict) -> float:
        t0 = time.perf_counter()
        self._compile(schema)
        return time.perf_counter() - t0

    def walk(self, schema: dict, ids: list[int]) -> list[float]:
        m = self.xgr.GrammarMatcher(self._compile(schema))
        bitmask = self.xgr.allocate_token_bitmask(1, self.vocab_size)
        times = []
        for tok in ids:
            t0 = time.perf_counter()
            m.fill_next_token_bitmask(bitmask, 0)
            assert (bitmask[0, tok // 32] >> (tok % 32)) & 1, "xgrammar refused the document's token"
            m.accept_token(tok)
            times.append(time.perf_counter() - t0)
        return times


def bench_engines(tokenizer, rounds: int) -> None:
    engines = [LLGuidance(tokenizer)]
    try:
        engines.append(XGrammar(tokenizer))
    except ImportError:
        log("xgrammar is not installed here: llguidance alone (see this file's docstring)")
    for doc_name, (schema, doc) in DOCS.items():
        ids = tokenizer.encode(json.dumps(doc), add_bos=False)
        compiles = interleave({e.name: (lambda e=e: e.compile_s(schema)) for e in engines}, rounds)
        walks = interleave({e.name: (lambda e=e: e.walk(schema, ids)) for e in engines}, rounds)
        for e in engines:
            per_token = [t for run in walks[e.name][1:] for t in run]  # the first walk warms the caches
            totals = [sum(run) / len(run) for run in walks[e.name][1:]]
            emit(f"mask_and_advance_{doc_name}_{e.name}", statistics.median(per_token) * 1e6, "us/token (median)",
                 p90_us=percentile(per_token, 90) * 1e6, mean_us=statistics.mean(per_token) * 1e6,
                 mean_us_best_round=min(totals) * 1e6, tokens=len(ids), rounds=rounds - 1)
            emit(f"compile_{doc_name}_{e.name}", statistics.median(compiles[e.name]) * 1e3, "ms (median)")


class Steps:
    """Decode steps of `bsz` sequences in the serving engine (auto dtype, packed decode), constrained or not."""

    def __init__(self, tokenizer, bsz: int, num_steps: int):
        from common.engine.engine import Engine, EngineConfig
        from common.engine.runner import ModelRunner

        runner = ModelRunner.load("smollm2", num_blocks=1 + bsz * 40, progress=False)
        self.engine = Engine(runner, tokenizer, EngineConfig(max_running=64, detokenize=False))
        # The sampling of each step timed on its own (masks filled and added, then the sampler): the mask's cost
        # without the forward pass's noise on a shared machine.
        self.sample_s: list[float] = []
        sample = self.engine._sample

        def timed(batch, logits):
            t0 = time.perf_counter()
            out = sample(batch, logits)
            self.sample_s.append(time.perf_counter() - t0)
            return out

        self.engine._sample = timed
        self.tokenizer = tokenizer
        self.bsz = bsz
        self.num_steps = num_steps
        question = "Write six orders as JSON."
        self.prompt = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": question}]))

    def run(self, constrained: bool) -> tuple[float, float]:
        """Seconds per decode step and per step's sampling, over num_steps steps once every sequence decodes."""
        from common.engine.grammar import Constraint
        from common.engine.sampling import SamplingParams
        c = Constraint("json_schema", json.dumps(LONG)) if constrained else None
        e = self.engine
        done = []
        for i in range(self.bsz):
            p = SamplingParams(temperature=0.0, max_tokens=self.num_steps + 4, ignore_eos=not constrained,
                               constraint=c)
            e.submit(f"s{i}", self.prompt, p, lambda ev: ev.finish_reason is not None and done.append(ev))
        while e.waiting or e.prefilling:
            e.step()
        e.step()  # the first decode step (its batch settles)
        assert len(e.running) == self.bsz
        self.sample_s.clear()
        t0 = time.perf_counter()
        for _ in range(self.num_steps):
            e.step()
        dt = (time.perf_counter() - t0) / self.num_steps
        sample_s = statistics.median(self.sample_s)
        assert len(e.running) == self.bsz and not done, "a sequence ended within the measured steps"
        while e.num_active:
            e.step()
        return dt, sample_s


def bench_engine(tokenizer, rounds: int, num_steps: int) -> None:
    for bsz in (1, 32):
        steps = Steps(tokenizer, bsz, num_steps)
        got = interleave({"free": lambda: steps.run(False), "constrained": lambda: steps.run(True)}, rounds)
        free, con = (statistics.median(s for s, _ in got[k][1:]) for k in ("free", "constrained"))
        free_sample, con_sample = (statistics.median(s for _, s in got[k][1:]) for k in ("free", "constrained"))
        emit(f"decode_step_constrained_b{bsz}", con * 1e3, "ms/step (median of rounds)", peer="unconstrained",
             peer_value=free * 1e3, overhead_ms_per_step=(con - free) * 1e3, steps=num_steps, rounds=rounds - 1)
        emit(f"sampling_constrained_b{bsz}", con_sample * 1e3, "ms/step (median)", peer="unconstrained",
             peer_value=free_sample * 1e3, mask_ms_per_step=(con_sample - free_sample) * 1e3,
             mask_us_per_token=(con_sample - free_sample) / bsz * 1e6,
             mask_share_of_step=(con_sample - free_sample) / free)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", choices=["engines", "engine"], help="one part only")
    ap.add_argument("--rounds", type=int, default=6, help="turns of each side (the first is warm-up)")
    ap.add_argument("--steps", type=int, default=24, help="decode steps measured per turn (part 2)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads (part 2)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from common.engine.model_files import resolve_model_path
    from common.engine.tokenizer import load_tokenizer
    tokenizer = load_tokenizer(resolve_model_path("smollm2"))
    import llguidance
    versions = {"llguidance": llguidance.__version__}
    try:
        versions["xgrammar"] = importlib.metadata.version("xgrammar")
    except importlib.metadata.PackageNotFoundError:
        pass
    emit_machine(torch_threads=args.threads, **versions)
    emit_load_avg("start")
    if args.only in (None, "engines"):
        bench_engines(tokenizer, args.rounds)
    if args.only in (None, "engine"):
        bench_engine(tokenizer, args.rounds, args.steps)
    emit_load_avg("end")


if __name__ == "__main__":
    main()
