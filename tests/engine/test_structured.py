"""Structured outputs in the engine: every constrained completion matches its constraint and ends with STOP where
it is met; the mask leaves the other rows' bits alone (a constrained row and its neighbours sample the same tokens
alone and batched); a resumed sequence's matcher is replayed over its output_ids and continues with exactly the
tokens of an uninterrupted run, greedy and seeded; a prefill-only engine's first token is the colocated one; a
constraint broken by output_ids, or one that allows no token, ends the request with an error that is the
request's own (TokenEvent.invalid). The real model, no mocks."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from common.engine.grammar import Constraint, GrammarCompiler, allowed_from_bitmask, bitmask_words, fill_bitmask
from common.engine.output import FinishReason
from common.engine.sampling import Sampler, SamplingParams, apply_bitmask
from common.pb_convert import sampling_from_pb, sampling_to_pb
from tests.support.engine import Sinks, run_until_done

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "age"], "additionalProperties": False}
QUESTION = "Give me a JSON object describing a person named Bob who is 42."

CONSTRAINTS = {
    "json_schema": Constraint("json_schema", json.dumps(PERSON)),  # json_object: tests/router (it runs long here)
    "regex": Constraint("regex", r"[0-9]{3}-[a-z]{2}"),
    "choice": Constraint("choice", choices=("Paris", "London", "Rome")),
    "grammar": Constraint("grammar", 'root ::= "yes" | "no" | "maybe"'),  # GBNF
}


def matches(kind: str, text: str) -> bool:
    if kind == "json_schema":
        jsonschema.validate(json.loads(text), PERSON)
        return True
    if kind == "regex":
        return re.fullmatch(r"[0-9]{3}-[a-z]{2}", text) is not None
    if kind == "choice":
        return text in ("Paris", "London", "Rome")
    return text in ("yes", "no", "maybe")


@pytest.fixture(scope="module")
def engine(make_engine):
    return make_engine(num_blocks=256)


@pytest.fixture(scope="module")
def prompt(chat_ids):
    return chat_ids(QUESTION)


def run(engine, reqs: dict[str, tuple[list[int], SamplingParams, list[int]]]) -> Sinks:
    """seq_id -> (prompt, params, output_ids): submitted together, stepped to the end."""
    sinks = Sinks()
    for seq_id, (ids, params, output) in reqs.items():
        engine.submit(seq_id, ids, params, sinks.sink(seq_id), output_ids=output)
    run_until_done(engine, sinks)
    engine.check_integrity()
    return sinks


def params(kind: str, temperature: float = 0.0, **kw) -> SamplingParams:
    return SamplingParams(temperature=temperature, top_p=0.9 if temperature else 1.0, seed=5, max_tokens=48,
                          constraint=CONSTRAINTS[kind], **kw)


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "seeded"])
def test_every_kind_matches_and_stops_and_neighbours_keep_their_bits(engine, prompt, smollm2_tokenizer, temperature):
    free = SamplingParams(temperature=temperature, seed=9, max_tokens=12, ignore_eos=True)
    alone = {kind: run(engine, {kind: (prompt, params(kind, temperature), [])})[kind]
             for kind in ("json_schema", "regex")}
    free_alone = run(engine, {"free": (prompt, free, [])})["free"]
    batched = run(engine, {**{k: (prompt, params(k, temperature), []) for k in CONSTRAINTS},
                           "free": (prompt, free, [])})
    for kind in CONSTRAINTS:
        got = batched[kind]
        text = smollm2_tokenizer.decode(got.token_ids, skip_special=True)
        assert got.finish_reason == FinishReason.STOP and got.token_ids[-1] == smollm2_tokenizer.eos_id, (kind, text)
        assert matches(kind, text), (kind, text)
    for kind, got in alone.items():
        assert batched[kind].token_ids == got.token_ids, f"{kind}: batched with others it sampled other tokens"
    # The unconstrained row beside five constrained ones: the same bits, so the same tokens.
    assert batched["free"].token_ids == free_alone.token_ids


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "seeded"])
def test_resume_replays_the_matcher_and_continues_exactly(engine, prompt, temperature):
    p = params("json_schema", temperature)
    whole = run(engine, {"whole": (prompt, p, [])})["whole"].token_ids
    assert len(whole) > 8
    cuts = [1, 4, len(whole) // 2, len(whole) - 1]
    resumed = run(engine, {f"cut{n}": (prompt, p, whole[:n]) for n in cuts})
    for n in cuts:
        assert whole[:n] + resumed[f"cut{n}"].token_ids == whole, f"resumed after {n} tokens, it went elsewhere"


def test_prefill_only_first_token_is_the_colocated_one(make_engine, engine, prompt):
    prefill = make_engine(num_blocks=64, prefill_only=True)
    for kind in ("json_schema", "choice"):
        p = params(kind, 1.0)
        first = run(prefill, {"p": (prompt, p, [])})["p"].token_ids
        whole = run(engine, {"c": (prompt, p, [])})["c"].token_ids
        assert first == whole[:1]


def test_output_ids_that_break_the_constraint_are_the_request_s_error(engine, prompt, smollm2_tokenizer):
    bad = smollm2_tokenizer.encode("Hello", add_bos=False)  # a JSON schema's completion starts with "{"
    got = run(engine, {"bad": (prompt, params("json_schema"), bad)})["bad"]
    assert got.finish_reason == FinishReason.ERROR and got.events[-1].invalid
    assert "does not match the structured output constraint" in got.error


def test_a_dead_end_ends_the_request_with_its_own_error(engine, prompt):
    """A matcher that allows no token (here one driven into its error state by hand, as a grammar's limits
    would) ends the sequence with an error naming the dead end; its blocks are freed."""
    sinks = Sinks()
    engine.submit("dead", prompt, params("json_schema"), sinks.sink("dead"))
    while not sinks["dead"].events:  # prefilled, first token sampled
        engine.step()
    engine.scheduler.seqs["dead"].matcher.consume_token(0)  # <|endoftext|> is not JSON: error state
    run_until_done(engine, sinks)
    engine.check_integrity()
    got = sinks["dead"]
    assert got.finish_reason == FinishReason.ERROR and got.events[-1].invalid
    assert "dead end" in got.error


def test_bitmask_masks_only_its_rows():
    torch.manual_seed(0)
    logits = torch.randn(3, 70)
    bitmask = torch.zeros(1, bitmask_words(70), dtype=torch.int32)
    bitmask[0, 1] = 1 << 3  # token 35 only
    out = apply_bitmask(logits, [1], bitmask)
    assert torch.equal(out[0], logits[0]) and torch.equal(out[2], logits[2])
    assert out[1].isinf().sum() == 69 and out[1, 35] == logits[1, 35]
    assert torch.equal(logits, logits.clone())  # the caller's tensor is untouched
    sampler = Sampler()
    ps = [SamplingParams(temperature=1.0, seed=s) for s in (1, 2, 3)]
    tokens = sampler(logits, ps, [1, 2, 3], [0, 0, 0], [[], [], []], [[], [], []], [1], bitmask)
    plain = sampler(logits, ps, [1, 2, 3], [0, 0, 0], [[], [], []], [[], [], []])
    assert tokens[1] == 35 and tokens[0] == plain[0] and tokens[2] == plain[2]


def test_compiler_masks_the_vocabulary_and_names_bad_constraints(smollm2_tokenizer):
    compiler = GrammarCompiler(smollm2_tokenizer)
    m = compiler.matcher(CONSTRAINTS["choice"])
    bitmask = torch.empty(1, bitmask_words(compiler.vocab_size), dtype=torch.int32)
    fill_bitmask([m], bitmask)
    allowed = allowed_from_bitmask(bitmask, compiler.vocab_size)[0].nonzero().flatten().tolist()
    texts = {smollm2_tokenizer.decode([t]) for t in allowed}
    assert "Paris" in texts or "P" in texts
    assert all(any(c.startswith(t) for c in ("Paris", "London", "Rome")) for t in texts), texts
    for bad, why in [(Constraint("json_schema", '{"type": "foo"}'), "foo"),
                     (Constraint("json_schema", "{not json"), "not valid JSON"),
                     (Constraint("regex", "[a-"), "unclosed character class"),
                     (Constraint("grammar", "start: undefined_rule"), "undefined_rule"),
                     (Constraint("choice", choices=()), "choice"),
                     (Constraint("regex", ""), "must not be empty")]:
        with pytest.raises(ValueError, match=re.escape(why)):
            compiler.check(bad)


def test_constraints_cross_the_wire_and_refuse_ignore_eos():
    for c in CONSTRAINTS.values():
        p = SamplingParams(temperature=0.0, max_tokens=8, constraint=c)
        back, _ = sampling_from_pb(sampling_to_pb(p, 1), vocab_size=49152)
        assert back.constraint == c
    with pytest.raises(ValueError, match="ignore_eos"):
        SamplingParams(ignore_eos=True, constraint=CONSTRAINTS["regex"]).validate()
