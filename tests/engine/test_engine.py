"""The Engine on SmolLM2 in fp32: batched paged decode against runs alone, continuous batching, seeded
sampling, every way a sequence ends, resume from tokens and from exported K/V, preemption, and pools
too small for a request. Every test ends with every KV block free."""
from __future__ import annotations

import logging
import threading
from dataclasses import replace

import pytest
import torch

from common.engine.engine import Engine
from common.engine.kv_cache import KVCache
from common.engine.model import Llama
from common.engine.output import FinishReason
from common.engine.runner import ModelRunner
from common.engine.sampling import SamplingParams
from tests.support.engine import CHAT_QUESTION, Sinks, run_until_done
from tests.support.native import skip_where_bf16_is_emulated

N = 16  # tokens per reference run
BLOCK = 4  # small blocks: every sequence spans many, and crosses block boundaries while decoding
GREEDY = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=N)

TEXTS = {
    "b": "Once upon a time,",
    "c": "def add(a, b):\n    return",
    "d": ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
          "combined movable metal type, oil-based inks and a wooden press adapted from those used for wine. "
          "Before that, books in Europe were copied by hand"),
}


@pytest.fixture(scope="module")
def prompts(smollm2_tokenizer, chat_ids) -> dict[str, list[int]]:
    p = {"a": chat_ids(CHAT_QUESTION), **{k: smollm2_tokenizer.encode(t) for k, t in TEXTS.items()}}
    lens = [len(v) for v in p.values()]
    assert len(set(lens)) == len(lens) and min(lens) < 8 < 40 < max(lens), lens
    return p


def assert_all_free(engine: Engine) -> None:
    engine.check_integrity()
    assert engine.num_active == 0 and not engine.running and not engine.waiting
    assert engine.pool.num_free_blocks == engine.pool.num_blocks


def generate(engine: Engine, requests: dict[str, tuple[list[int], SamplingParams]], **submit_kw) -> Sinks:
    sinks = Sinks()
    for seq_id, (ids, params) in requests.items():
        engine.submit(seq_id, ids, params, sinks.sink(seq_id), **submit_kw)
    run_until_done(engine, sinks)
    assert_all_free(engine)
    return sinks


@pytest.fixture(scope="module")
def alone(make_engine, prompts) -> dict[str, list[int]]:
    """Each prompt's N greedy tokens, run on its own (batch 1 throughout)."""
    out = {}
    for name, ids in prompts.items():
        sinks = generate(make_engine(num_blocks=64, block_size=BLOCK), {name: (ids, GREEDY)})
        assert sinks[name].finish_reason == FinishReason.LENGTH
        out[name] = sinks[name].token_ids
        assert len(out[name]) == N
    return out


# --------------------------------------------------------------------------- batching

def test_batched_paged_decode_matches_alone(make_engine, prompts, alone):
    engine = make_engine(num_blocks=64, block_size=BLOCK)
    sinks = generate(engine, {name: (ids, GREEDY) for name, ids in prompts.items()})
    assert engine.num_steps == N - 1  # one prefill batch, then every step decodes all four together
    for name in prompts:
        assert sinks[name].token_ids == alone[name], name
        assert sinks[name].finish_reason == FinishReason.LENGTH


def test_continuous_batching_join_and_leave(make_engine, prompts, alone):
    engine = make_engine(num_blocks=64, block_size=BLOCK)
    # seq_id -> (step it is submitted at, max_tokens)
    plan = {"a": (0, N), "b": (2, 5), "c": (4, N), "d": (9, 7)}
    sinks = Sinks()
    batches = []
    for step in range(200):
        for name, (at, max_tokens) in plan.items():
            if at == step:
                engine.submit(name, prompts[name], replace(GREEDY, max_tokens=max_tokens), sinks.sink(name))
        engine.step()
        engine.check_integrity()
        batches.append(frozenset(s.seq_id for s in engine.running))
        if len(sinks) == len(plan) and all(c.done for c in sinks.values()):
            break
    assert_all_free(engine)
    for name, (_, max_tokens) in plan.items():
        assert sinks[name].token_ids == alone[name][:max_tokens], name
        assert sinks[name].finish_reason == FinishReason.LENGTH
    # Sequences really ran together and changed the batch while others were running.
    assert {"a", "b", "c"} in batches and {"a", "c", "d"} in batches, batches
    assert batches.index({"a", "c", "d"}) > batches.index({"a", "b", "c"})


def test_seeded_sampling_same_alone_and_in_mixed_batch(make_engine, prompts, alone):
    seeded = SamplingParams(temperature=0.8, top_p=0.9, seed=1234, max_tokens=N, ignore_eos=True)
    solo = generate(make_engine(num_blocks=64, block_size=BLOCK), {"s": (prompts["d"], seeded)})["s"].token_ids
    assert len(solo) == N
    assert solo != alone["d"]  # it really sampled (with this seed it leaves the greedy path)
    mixed = generate(make_engine(num_blocks=64, block_size=BLOCK), {
        "g": (prompts["a"], GREEDY),
        "k": (prompts["b"], SamplingParams(temperature=1.3, top_k=5, seed=7, max_tokens=N, ignore_eos=True)),
        "s": (prompts["d"], seeded),
        "p": (prompts["c"], SamplingParams(temperature=0.7, min_p=0.1, repetition_penalty=1.3,
                                           seed=99, max_tokens=N, ignore_eos=True)),
        "o": (prompts["d"], replace(seeded, seed=4321)),
    })
    assert mixed["s"].token_ids == solo
    assert mixed["g"].token_ids == alone["a"]
    assert mixed["o"].token_ids != solo  # the seed, not the prompt, decides


# --------------------------------------------------------------------------- how sequences end

def test_stop_string_cuts_text_before_it(make_engine, prompts, smollm2_tokenizer):
    tok = smollm2_tokenizer
    engine = make_engine(num_blocks=64, block_size=BLOCK)
    sinks = generate(engine, {
        "one_token": (prompts["a"], replace(GREEDY, max_tokens=32, stop=("Paris",))),
        "across_tokens": (prompts["a"], replace(GREEDY, max_tokens=32, stop=("of Fr", "never said"))),
        "absent": (prompts["a"], replace(GREEDY, max_tokens=8, stop=("Berlin",))),
    })
    assert sinks["one_token"].finish_reason == FinishReason.STOP
    assert sinks["one_token"].text == "The capital of France is "
    assert tok.decode(sinks["one_token"].token_ids).endswith(" Paris")  # stopped at the token that completed it
    assert sinks["across_tokens"].finish_reason == FinishReason.STOP
    assert sinks["across_tokens"].text == "The capital "
    assert sinks["absent"].finish_reason == FinishReason.LENGTH
    assert len(sinks["absent"].token_ids) == 8
    assert sinks["absent"].text == tok.decode(sinks["absent"].token_ids, skip_special=True)


def test_stop_token_ids_max_tokens_and_eos(make_engine, prompts, alone, smollm2_tokenizer):
    tok = smollm2_tokenizer
    greedy = alone["a"]
    assert tok.decode(greedy[:8]) == "The capital of France is Paris.<|im_end|>" and greedy[7] == tok.eos_id
    stop_id = greedy[3]  # " France"
    engine = make_engine(num_blocks=64, block_size=BLOCK)
    sinks = generate(engine, {
        "stop_id": (prompts["a"], replace(GREEDY, max_tokens=32, stop_token_ids=(stop_id,))),
        "length": (prompts["a"], replace(GREEDY, max_tokens=5)),
        "eos": (prompts["a"], SamplingParams(temperature=0.0, max_tokens=32)),
    })
    # The stop token is reported (its id ends the sequence) but its text is not emitted.
    assert sinks["stop_id"].finish_reason == FinishReason.STOP
    assert sinks["stop_id"].token_ids == greedy[:4]
    assert sinks["stop_id"].text == "The capital of"
    assert sinks["length"].finish_reason == FinishReason.LENGTH
    assert sinks["length"].token_ids == greedy[:5]
    assert sinks["length"].text == tok.decode(greedy[:5])
    assert sinks["eos"].finish_reason == FinishReason.STOP
    assert sinks["eos"].token_ids == greedy[:8]
    assert sinks["eos"].text == "The capital of France is Paris."


def test_context_window_ends_with_length(smollm2_weights, smollm2_tokenizer, prompts, alone):
    # The same weights with a context only 3 tokens longer than the prompt: 3 tokens, whatever max_tokens.
    w = smollm2_weights
    config = replace(w.config, max_position=len(prompts["d"]) + 3)
    model = Llama(config, w.tensors, dtype=torch.float32)
    engine = Engine(ModelRunner(model, KVCache(config, 64, BLOCK, torch.float32), 0), smollm2_tokenizer)
    sinks = generate(engine, {"d": (prompts["d"], replace(GREEDY, max_tokens=100))})
    assert sinks["d"].finish_reason == FinishReason.LENGTH
    assert sinks["d"].token_ids == alone["d"][:3]


def test_cancel_running_and_waiting(make_engine, prompts):
    engine = make_engine(num_blocks=64, block_size=BLOCK)
    sinks = Sinks()
    engine.submit("run", prompts["d"], replace(GREEDY, max_tokens=200), sinks.sink("run"))
    for _ in range(3):
        engine.step()
    assert engine.pool.num_used_blocks > 0
    engine.cancel("run")
    engine.submit("wait", prompts["b"], GREEDY, sinks.sink("wait"))
    engine.cancel("wait")  # cancelled before it was ever scheduled
    engine.cancel("unknown")  # no such sequence: nothing happens
    engine.step()
    assert sinks["run"].finish_reason == FinishReason.CANCELLED
    assert len(sinks["run"].token_ids) == 4  # prefill's token, then one per step
    assert sinks["wait"].finish_reason == FinishReason.CANCELLED and sinks["wait"].token_ids == []
    assert_all_free(engine)
    # The engine serves on after cancellations.
    after = generate(engine, {"next": (prompts["b"], replace(GREEDY, max_tokens=3))})
    assert len(after["next"].token_ids) == 3


def test_started_engine_streams_and_stop_cancels(make_engine, prompts, alone):
    engine = make_engine(num_blocks=64, block_size=BLOCK).start()
    sinks = Sinks()
    done = threading.Event()
    first = sinks.sink("short")

    def short_sink(event):
        first(event)
        if event.finish_reason is not None:
            done.set()

    try:
        engine.submit("long", prompts["d"], replace(GREEDY, max_tokens=10_000), sinks.sink("long"))
        engine.submit("short", prompts["b"], replace(GREEDY, max_tokens=4), short_sink)
        assert done.wait(60), "the engine thread did not finish a 4-token request in 60 s"
    finally:
        engine.stop()
    assert sinks["short"].token_ids == alone["b"][:4]
    assert sinks["long"].finish_reason == FinishReason.CANCELLED and sinks["long"].error == "engine stopped"
    assert_all_free(engine)


# --------------------------------------------------------------------------- resume

def test_resume_from_output_ids(make_engine, prompts, alone):
    engine = make_engine(num_blocks=64, block_size=BLOCK)
    k = 5
    resumed = Sinks()
    for name in ("a", "d"):
        engine.submit(name, prompts[name], GREEDY, resumed.sink(name), output_ids=alone[name][:k])
    run_until_done(engine, resumed)
    assert_all_free(engine)
    for name in ("a", "d"):
        # max_tokens counts the earlier tokens too: the resumed run adds the missing N - k.
        assert resumed[name].token_ids == alone[name][k:], name
        assert resumed[name].finish_reason == FinishReason.LENGTH


def test_resume_already_finished_output_ids(make_engine, prompts, alone):
    engine = make_engine(num_blocks=64, block_size=BLOCK)
    sinks = Sinks()
    engine.submit("a", prompts["a"], replace(GREEDY, max_tokens=3), sinks.sink("a"), output_ids=alone["a"][:3])
    assert sinks["a"].finish_reason == FinishReason.LENGTH and sinks["a"].token_ids == []
    assert engine.num_active == 0


@pytest.mark.parametrize("params", [GREEDY, SamplingParams(temperature=0.8, top_p=0.9, seed=1234, max_tokens=N,
                                                           ignore_eos=True)], ids=["greedy", "seeded"])
def test_resume_from_exported_kv(make_engine, prompts, params):
    """What the split does: a prefill-only engine samples the first token and exports the K/V, a decode
    engine imports it and continues; the tokens equal one uninterrupted run."""
    names = ("a", "d")
    whole = generate(make_engine(num_blocks=64, block_size=BLOCK), {n: (prompts[n], params) for n in names})
    prefill = make_engine(num_blocks=64, block_size=BLOCK, prefill_only=True)
    exported = generate(prefill, {n: (prompts[n], params) for n in names})
    decode = make_engine(num_blocks=64, block_size=BLOCK)
    sinks = Sinks()
    for n in names:
        event = exported[n].events[-1]
        assert event.finish_reason is None and len(exported[n].events) == 1
        assert event.token_ids == whole[n].token_ids[:1]
        assert event.kv.shape[2] == len(prompts[n])  # every prompt token, not the sampled one
        decode.submit(n, prompts[n], params, sinks.sink(n), output_ids=event.token_ids, kv=event.kv)
    # No prefill on the decode side: the first step already decodes both.
    decode.step()
    assert sorted(len(sinks[n].token_ids) for n in names) == [1, 1]
    run_until_done(decode, sinks)
    assert_all_free(decode)
    for n in names:
        assert sinks[n].token_ids == whole[n].token_ids[1:], n
        assert sinks[n].finish_reason == FinishReason.LENGTH


# --------------------------------------------------------------------------- small pools

def test_preemption_recomputes_same_tokens(make_engine, prompts, alone, caplog):
    # The four sequences need 12 + 6 + 7 + 17 = 42 blocks of 4 at the end; 24 hold the largest alone.
    need = {n: -(-(len(ids) + N) // BLOCK) for n, ids in prompts.items()}
    num_blocks = max(need.values()) + 4
    assert sum(need.values()) > num_blocks + 8
    engine = make_engine(num_blocks=num_blocks, block_size=BLOCK)
    with caplog.at_level(logging.WARNING, logger="common.engine.engine"):
        sinks = generate(engine, {name: (ids, GREEDY) for name, ids in prompts.items()})
    assert "preempting" in caplog.text
    for name in prompts:
        assert sinks[name].token_ids == alone[name], name
        assert sinks[name].finish_reason == FinishReason.LENGTH


def test_preemption_evicts_the_newest(make_engine, prompts, caplog):
    """scheduler.py says "preempt the newest on shortage": the sequence admitted last loses its K/V, so
    the oldest (with the most tokens to recompute) keeps going."""
    need = {n: -(-(len(ids) + N) // BLOCK) for n, ids in prompts.items()}
    engine = make_engine(num_blocks=max(need.values()) + 4, block_size=BLOCK)
    sinks = Sinks()
    with caplog.at_level(logging.WARNING, logger="common.engine.engine"):
        for name, ids in prompts.items():  # admitted together, in this order: "d" is the newest
            engine.submit(name, ids, GREEDY, sinks.sink(name))
        for _ in range(N):
            running = [s.seq_id for s in engine.running]  # admission order, oldest first
            engine.step()
            victims = [r.args[0] for r in caplog.records if "preempting" in r.getMessage()]
            if victims:
                break
    for name in prompts:
        engine.cancel(name)
    engine.step()
    assert_all_free(engine)
    assert len(running) > 1 and victims and victims[0] == running[-1], \
        f"preempted {victims}, running in admission order {running}"


def test_prompt_too_big_for_pool_errors_and_others_are_served(make_engine, prompts, alone):
    # 10 blocks of 4 = 40 tokens: "d" alone needs 17 blocks; "b" and "c" fit together.
    engine = make_engine(num_blocks=10, block_size=BLOCK)
    short = replace(GREEDY, max_tokens=8)
    sinks = generate(engine, {"b": (prompts["b"], short), "d": (prompts["d"], short), "c": (prompts["c"], short)})
    assert sinks["d"].finish_reason == FinishReason.ERROR
    assert sinks["d"].token_ids == []
    assert f"sequence of {len(prompts['d']) + 1} tokens" in sinks["d"].error and "KV blocks" in sinks["d"].error
    assert sinks["b"].token_ids == alone["b"][:8] and sinks["c"].token_ids == alone["c"][:8]
    after = generate(engine, {"b2": (prompts["b"], short)})
    assert after["b2"].token_ids == alone["b"][:8]


def test_imported_kv_too_big_for_pool_errors_and_others_are_served(make_engine, prompts, alone):
    """A decode engine whose pool cannot hold an arriving sequence must fail it, not hold it forever
    at the head of the queue (where it also blocks every request behind it)."""
    prefill = make_engine(num_blocks=64, block_size=BLOCK, prefill_only=True)
    exported = generate(prefill, {"d": (prompts["d"], GREEDY)})["d"].events[-1]
    decode = make_engine(num_blocks=10, block_size=BLOCK)
    sinks = Sinks()
    decode.submit("d", prompts["d"], GREEDY, sinks.sink("d"), output_ids=exported.token_ids, kv=exported.kv)
    decode.submit("b", prompts["b"], replace(GREEDY, max_tokens=8), sinks.sink("b"))
    run_until_done(decode, sinks, max_steps=100)
    assert sinks["d"].finish_reason == FinishReason.ERROR and "KV blocks" in sinks["d"].error
    assert sinks["b"].token_ids == alone["b"][:8]
    assert_all_free(decode)


@pytest.mark.parametrize("packed_decode", [False, True], ids=["bf16", "bf16+int4"])
def test_bf16_tokens_do_not_depend_on_the_batch(make_engine, prompts, packed_decode):
    """Invariant 4 in the serving dtype: a sequence's greedy tokens are the same alone and decoded
    beside others of different lengths (one weight format at every batch size)."""
    # On AVX2 hosts the serving cases below (fp32+int4, fp32) cover both.
    skip_where_bf16_is_emulated("bf16+int4 decode" if packed_decode else "dense bf16 decode")
    kw = dict(dtype=torch.bfloat16, packed_decode=packed_decode, block_size=BLOCK)
    solo = {n: generate(make_engine(num_blocks=64, **kw), {n: (ids, GREEDY)})[n].token_ids
            for n, ids in prompts.items()}
    together = generate(make_engine(num_blocks=256, **kw), {n: (ids, GREEDY) for n, ids in prompts.items()})
    for name in prompts:
        assert together[name].token_ids == solo[name], name


# ------------------------------ invariant 4 (same inputs, same tokens), serving dtype
# What a worker runs by default: packed int4 decode over bf16 (hosts with native bf16) or fp32 (the
# others; `--dtype auto`); dense fp32 decode is the extra case.

SERVING = [dict(dtype=torch.bfloat16, packed_decode=True), dict(dtype=torch.float32, packed_decode=True),
           dict(dtype=torch.float32)]
SERVING_IDS = ["bf16+int4", "fp32+int4", "fp32"]
SAMPLED = SamplingParams(temperature=1.0, top_p=0.95, seed=20261201, max_tokens=N, ignore_eos=True)


def _mixed_requests(prompts) -> dict[str, tuple[list[int], SamplingParams]]:
    """Greedy and seeded sampled requests over every prompt (three kinds of sampling): the company each one
    decodes in. 16 of them, so that a step's batch reaches 13 rows, where the int8 digit kernel (the
    default on AMX hosts) moves from its vector half to its tiles."""
    reqs = {f"g-{n}": (ids, GREEDY) for n, ids in prompts.items()}
    reqs |= {f"s-{n}": (ids, replace(SAMPLED, seed=SAMPLED.seed + i)) for i, (n, ids) in enumerate(prompts.items())}
    reqs |= {f"k-{n}": (ids, replace(SAMPLED, temperature=0.7, top_k=40, top_p=1.0, seed=SAMPLED.seed + 100 + i))
             for i, (n, ids) in enumerate(prompts.items())}
    reqs |= {f"p-{n}": (ids, replace(SAMPLED, min_p=0.05, repetition_penalty=1.2, seed=SAMPLED.seed + 200 + i))
             for i, (n, ids) in enumerate(prompts.items())}
    assert len(reqs) >= 13
    return reqs


@pytest.fixture(scope="module", params=SERVING, ids=SERVING_IDS)
def serving(request, make_engine, prompts):
    """(engine kwargs, every request's tokens decoded alone)."""
    if request.param["dtype"] == torch.bfloat16:  # the default of hosts with native bf16; fp32+int4 is AVX2 hosts'
        skip_where_bf16_is_emulated("bf16+int4 decode")
    kw = dict(request.param, block_size=BLOCK)
    solo = {name: generate(make_engine(num_blocks=64, **kw), {name: req})[name].token_ids
            for name, req in _mixed_requests(prompts).items()}
    return kw, solo


def test_sampled_and_greedy_tokens_do_not_depend_on_the_batch(make_engine, prompts, serving):
    kw, solo = serving
    together = generate(make_engine(num_blocks=256, **kw), _mixed_requests(prompts))
    assert {n: c.token_ids for n, c in together.items()} == solo
    assert any(solo[f"s-{n}"] != solo[f"g-{n}"] for n in prompts), "the seeded requests did not sample"


def test_resume_replays_the_completion_and_continues_exactly(make_engine, prompts, serving):
    """What a failover does: the prompt is prefilled alone and the tokens already streamed are
    replayed as decode rows (several per step), then decoding goes on with the same tokens as a run
    that was never interrupted, greedy and sampled, while other sequences decode beside it."""
    kw, solo = serving
    reqs = _mixed_requests(prompts)
    engine = make_engine(num_blocks=256, max_replay_rows=4, **kw)
    replay_rows: list[int] = []  # rows that only recompute K/V, per decode step
    decode = engine.runner.decode

    def counting_decode(items):
        replay_rows.append(sum(not it.sample for it in items))
        return decode(items)

    engine.runner.decode = counting_decode
    sinks = Sinks()
    for i, (name, (ids, params)) in enumerate(reqs.items()):
        k = 1 + i % (N - 2)  # tokens already streamed before the "failover": 1 .. N-2
        engine.submit(name, ids, params, sinks.sink(name), output_ids=solo[name][:k])
    run_until_done(engine, sinks)
    assert_all_free(engine)
    for i, name in enumerate(reqs):
        k = 1 + i % (N - 2)
        assert sinks[name].token_ids == solo[name][k:], name
    # Every token before the newest is replayed once, at most 4 rows a step.
    assert sum(replay_rows) == sum(i % (N - 2) for i in range(len(reqs)))
    assert max(replay_rows) == 4, replay_rows


def test_resume_from_parked_kv_replays_the_completion(make_engine, prompts, serving):
    """The decode worker's path: the prompt's K/V from a prefill-only engine is parked in the pool,
    then claimed by a sequence that already streamed some tokens."""
    kw, solo = serving
    reqs = _mixed_requests(prompts)
    prefill = make_engine(num_blocks=256, prefill_only=True, **kw)
    decode = make_engine(num_blocks=256, **kw)
    sinks = Sinks()
    for i, (name, (ids, params)) in enumerate(reqs.items()):
        k = 1 + (3 * i) % (N - 1)
        exported = generate(prefill, {name: (ids, params)}, output_ids=solo[name][:k])[name].events[-1]
        assert exported.token_ids == [] and exported.kv.shape[2] == len(ids)  # resumed: K/V only
        parked = decode.park(name, exported.kv)
        decode.step()  # placed by the engine's next step
        assert parked.result(timeout=0) is None
        decode.submit(name, ids, params, sinks.sink(name), output_ids=solo[name][:k], parked=True)
    run_until_done(decode, sinks)
    assert_all_free(decode)
    for i, name in enumerate(reqs):
        k = 1 + (3 * i) % (N - 1)
        assert sinks[name].token_ids == solo[name][k:], name


def test_a_prefill_worker_runs_the_shortest_prompt_next_and_never_starves_a_long_one(make_engine, prompts):
    """prefill_only: one chunk a step, of the prompt with the fewest tokens left, so a short prompt that
    comes during a long one's prefill gets its first token after one chunk; a prompt passed over for a
    budget's worth of chunks runs next. First tokens and K/V are those of each prompt prefilled alone."""
    chunk = 8
    cfg = dict(num_blocks=64, block_size=BLOCK, prefill_only=True, prefill_chunk_tokens=chunk,
               max_prefill_tokens=2 * chunk)  # passed over twice: runs next
    long_ids, short_ids = prompts["d"], prompts["b"]
    assert len(long_ids) > 4 * chunk and len(short_ids) <= chunk
    solo = {name: generate(make_engine(**cfg), {name: (ids, GREEDY)})[name].events[-1]
            for name, ids in (("long", long_ids), ("short", short_ids))}
    engine = make_engine(**cfg)
    sinks = Sinks()
    engine.submit("long", long_ids, GREEDY, sinks.sink("long"))
    engine.step()
    for name in ("s1", "s2", "s3"):
        engine.submit(name, short_ids, GREEDY, sinks.sink(name))
    order = []  # what each step ran: a short prompt (its first token), or a chunk of the long one
    seqs = engine.scheduler.seqs  # the engine's live sequences, by id
    for _ in range(20):
        if all(c.done for c in sinks.values()):
            break
        before = {name: c.done for name, c in sinks.items()}
        long_computed = seqs["long"].num_computed if "long" in seqs else None
        engine.step()
        order += [name for name, c in sinks.items() if c.done and not before[name] and name != "long"]
        if "long" in seqs and seqs["long"].num_computed != long_computed or sinks["long"].done \
                and not before["long"]:
            order.append("long")
    assert order[:4] == ["s1", "s2", "long", "s3"], order  # s1 and s2 first; then the long one, overdue
    assert all(sinks[name].done for name in sinks)
    for name, ref in (("long", solo["long"]), *((s, solo["short"]) for s in ("s1", "s2", "s3"))):
        got = sinks[name].events[-1]
        assert got.token_ids == ref.token_ids and torch.equal(got.kv, ref.kv), name
    assert_all_free(engine)


def test_a_claimed_park_joins_the_next_step_and_an_unclaimed_one_is_freed(make_engine, prompts, serving):
    """The decode worker's handoff: the claim runs on the engine thread as the K/V is placed, so the
    Decode it submits decodes in that same step (its second token after one step, not two); a claim
    that says nobody wants the K/V any more frees it at once."""
    kw, solo = serving
    name, (ids, params) = next(iter(_mixed_requests(prompts).items()))
    prefill = make_engine(num_blocks=256, prefill_only=True, **kw)
    decode = make_engine(num_blocks=256, **kw)
    exported = generate(prefill, {name: (ids, params)}, output_ids=solo[name][:1])[name].events[-1]
    sinks = Sinks()
    claimed = decode.park(name, exported.kv, claim=lambda: decode.submit(
        name, ids, params, sinks.sink(name), output_ids=solo[name][:1], parked=True) or True)
    unclaimed = decode.park("nobody", exported.kv, claim=lambda: False)
    decode.step()
    assert claimed.result(timeout=0) is None
    assert unclaimed.result(timeout=0).code == "unclaimed"
    assert sinks[name].token_ids == solo[name][1:2]  # decoded in the step that placed it
    assert decode.num_parked == 0
    run_until_done(decode, sinks)
    assert sinks[name].token_ids == solo[name][1:]
    assert_all_free(decode)


def test_preemption_recomputes_same_tokens_in_the_serving_dtype(make_engine, prompts, serving, caplog):
    kw, solo = serving
    reqs = _mixed_requests(prompts)
    need = {n: -(-(len(ids) + N) // BLOCK) for n, (ids, _) in reqs.items()}
    engine = make_engine(num_blocks=max(need.values()) + 8, **kw)
    with caplog.at_level(logging.WARNING, logger="common.engine.engine"):
        sinks = generate(engine, reqs)
    assert "preempting" in caplog.text
    assert {n: c.token_ids for n, c in sinks.items()} == solo


def test_parked_kv_is_counted_in_the_pool_and_freed_by_cancel(make_engine, prompts):
    prefill = make_engine(num_blocks=64, block_size=BLOCK, prefill_only=True)
    kv = generate(prefill, {"d": (prompts["d"], GREEDY)})["d"].events[-1].kv
    decode = make_engine(num_blocks=len(prompts["d"]) // BLOCK + 2, block_size=BLOCK)
    first = decode.park("d1", kv)
    second = decode.park("d2", kv)
    decode.step()
    assert first.result(timeout=0) is None
    assert second.result(timeout=0).code == "no_room" and "free blocks" in str(second.result())  # the pool cannot hold two: refused, nothing allocated
    assert decode.num_parked == 1 and decode.pool.num_free_blocks < decode.pool.num_blocks
    decode.check_integrity()
    decode.cancel("d1")
    decode.step()
    assert_all_free(decode)
    assert decode.num_parked == 0


# --------------------------------------------------------------------------- prefix caching

SYSTEM = ("You are a careful assistant for a small public library. You answer questions about opening hours, "
          "borrowing rules, fines, the reading room, children's events, the local history archive and the "
          "computers that visitors may use. ")


@pytest.fixture(scope="module")
def shared_prompts(smollm2_tokenizer):
    tok = smollm2_tokenizer
    ids = {q: tok.encode(tok.apply_chat_template([{"role": "system", "content": SYSTEM * 12},
                                                   {"role": "user", "content": q}]))
           for q in ("When do you open on Sundays?", "Can children borrow DVDs?")}
    # The same first chunk, then another system prompt: a partial hit.
    other = tok.encode(tok.apply_chat_template([{"role": "system", "content": SYSTEM * 8},
                                                {"role": "user", "content": "Where is the archive?"}]))
    return {**ids, "partial": other}


@pytest.mark.parametrize("kw", SERVING[:2], ids=SERVING_IDS[:2])
@pytest.mark.parametrize("params", [replace(GREEDY, max_tokens=8), replace(SAMPLED, max_tokens=8)],
                         ids=["greedy", "seeded"])
def test_prefix_cache_hits_change_no_token(make_engine, shared_prompts, kw, params):
    """Cold, warm (the same system prompt cached) and partial hits (only its first chunk shared) give the
    tokens of a cold run, in the serving dtypes: a cached prefix holds exactly the K/V its prefill
    chunks computed, and the suffix is computed in the same fixed chunks as a cold prefill."""
    if kw["dtype"] == torch.bfloat16:  # the serving dtype of hosts with native bf16; fp32+int4 is AVX2 hosts'
        skip_where_bf16_is_emulated("bf16+int4 prefix caching")
    names = list(shared_prompts)
    engine = make_engine(num_blocks=256, **kw)
    first = generate(engine, {names[0]: (shared_prompts[names[0]], params)})
    assert engine.num_cached_tokens == 0  # a cold run: the reference for the first prompt
    cold = {names[0]: first[names[0]].token_ids}
    cold.update({name: generate(make_engine(num_blocks=256, **kw), {name: (ids, params)})[name].token_ids
                 for name, ids in shared_prompts.items() if name != names[0]})
    warm = generate(engine, {n: (shared_prompts[n], params) for n in names})
    chunk = engine.hasher.chunk_tokens
    assert len(shared_prompts[names[0]]) > 2 * chunk
    # Both full prompts found their whole chunks; the partial one found the first.
    assert engine.num_cached_tokens == 2 * (len(shared_prompts[names[0]]) - 1) // chunk * chunk + chunk
    assert {n: warm[n].token_ids for n in names} == cold
    assert engine.pool.num_cached_blocks > 0 and engine.pool.num_free_blocks == engine.pool.num_blocks


def test_cached_prefixes_are_evicted_least_recently_used_when_the_pool_needs_room(make_engine, shared_prompts):
    engine = make_engine(num_blocks=80)  # room for about two of these prompts
    names = list(shared_prompts)
    for name in names:
        generate(engine, {name: (shared_prompts[name], GREEDY)})
    assert engine.pool.num_cached_blocks > 0
    # A prompt that needs the whole pool takes the cached blocks, oldest first; all stays consistent.
    big = list(range(1000, 1000 + 80 * 16 - N - 1))
    out = generate(engine, {"big": (big, GREEDY)})
    assert out["big"].finish_reason == FinishReason.LENGTH
    assert engine.pool.num_cached_blocks <= 80
    after = generate(engine, {names[0]: (shared_prompts[names[0]], GREEDY)})
    fresh = generate(make_engine(num_blocks=80), {names[0]: (shared_prompts[names[0]], GREEDY)})
    assert after[names[0]].token_ids == fresh[names[0]].token_ids


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_kv_sink_gets_the_prompts_kv_chunk_by_chunk_with_the_same_bits(make_engine, prompts, dtype):
    """prefill_only with a kv_sink (the streamed push): every computed chunk's K/V as it is ready, a
    prefix-cache hit's at admission; together bit-identical to the K/V a plain prefill exports, and the
    same first token."""
    ids = prompts["d"]
    chunk = 3 * BLOCK
    assert len(ids) > 3 * chunk and len(ids) % chunk
    plain = generate(make_engine(num_blocks=64, dtype=dtype, block_size=BLOCK, prefill_only=True,
                                 prefill_chunk_tokens=chunk), {"p": (ids, GREEDY)})["p"].events[-1]
    engine = make_engine(num_blocks=64, dtype=dtype, block_size=BLOCK, prefill_only=True, prefill_chunk_tokens=chunk)
    for run in ("cold", "warm"):
        pieces = []
        sinks = Sinks()
        engine.submit(run, ids, GREEDY, sinks.sink(run), kv_sink=lambda a, b, kv: pieces.append((a, b, kv)))
        for _ in range(100):  # its last event carries no K/V, which Sinks would wait for
            if sinks[run].events and engine.num_active == 0:
                break
            engine.step()
        assert len(sinks[run].events) == 1, run
        last = sinks[run].events[-1]
        assert last.kv is None and last.token_ids == plain.token_ids, run
        bounds = [(a, b) for a, b, _ in pieces]
        assert bounds[0][0] == 0 and bounds[-1][1] == len(ids)
        assert all(b1 == a2 for (_, b1), (a2, _) in zip(bounds, bounds[1:])), bounds
        if run == "cold":
            assert len(pieces) == -(-len(ids) // chunk)  # one per chunk
        else:  # the cached whole chunks in one piece, then the rest
            assert bounds[0] == (0, (len(ids) - 1) // chunk * chunk) and last.cached_tokens == bounds[0][1]
        got = torch.cat([kv for _, _, kv in pieces], dim=2)
        assert got.dtype == plain.kv.dtype and torch.equal(got.view(torch.uint8), plain.kv.view(torch.uint8)), run
    # A first token that ends the request: the last chunk's K/V is never handed over (nobody will decode).
    assert_all_free(engine)
    engine = make_engine(num_blocks=64, dtype=dtype, block_size=BLOCK, prefill_only=True, prefill_chunk_tokens=chunk)
    pieces = []
    sinks = Sinks()
    engine.submit("ends", ids, replace(GREEDY, max_tokens=1), sinks.sink("ends"),
                  kv_sink=lambda a, b, kv: pieces.append((a, b, kv)))
    run_until_done(engine, sinks)
    assert sinks["ends"].finish_reason == FinishReason.LENGTH
    assert [(a, b) for a, b, _ in pieces] == [(k, k + chunk) for k in range(0, (len(ids) - 1) // chunk * chunk, chunk)]
    assert_all_free(engine)
