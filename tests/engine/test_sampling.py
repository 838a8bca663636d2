"""Sampling settings, the batched sampler (masks, penalties, seeded determinism) and stop strings."""
from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from common.engine.sampling import (MAX_STOP_LEN, MAX_STOP_STRINGS, Sampler, SamplingParams, allowed_tokens,
                             apply_penalties, derive_seed, seeded_uniform)
from common.engine.stopping import StopStringMatcher

PROBS = [0.4, 0.25, 0.15, 0.1, 0.05, 0.03, 0.02]


def log_probs(probs: list[float]) -> torch.Tensor:
    return torch.tensor([[math.log(p) for p in probs]])  # [1, V]


def survivors(logits: torch.Tensor, **kw) -> set[int]:
    return set(allowed_tokens(logits, [SamplingParams(**kw)])[0].nonzero().flatten().tolist())


# --- masks -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kw, expected", [
    (dict(), {0, 1, 2, 3, 4, 5, 6}),
    (dict(top_k=1), {0}),
    (dict(top_k=3), {0, 1, 2}),
    (dict(top_k=7), {0, 1, 2, 3, 4, 5, 6}),
    (dict(top_k=100), {0, 1, 2, 3, 4, 5, 6}),
    (dict(top_p=0.3), {0}),
    (dict(top_p=0.5), {0, 1}),        # 0.4 < 0.5: the token that crosses p (0.25) is kept
    (dict(top_p=0.7), {0, 1, 2}),
    (dict(top_p=0.97), {0, 1, 2, 3, 4, 5}),
    (dict(top_k=2, top_p=0.5), {0}),  # top-k first, then top-p on the renormalised pair: 0.4/0.65 > 0.5
    (dict(top_k=2, top_p=0.7), {0, 1}),
    (dict(min_p=0.3), {0, 1, 2}),     # 0.15 >= 0.3 * 0.4 = 0.12 > 0.1
    (dict(min_p=0.5), {0, 1}),
    (dict(min_p=1.0), {0}),
    (dict(top_p=0.7, min_p=0.5), {0, 1}),
])
def test_masks_on_hand_made_distribution(kw, expected):
    assert survivors(log_probs(PROBS), **kw) == expected


def test_masks_keep_ties():
    tied = log_probs([0.4, 0.2, 0.2, 0.2])
    assert survivors(tied, top_k=2) == {0, 1, 2, 3}
    assert survivors(tied, top_p=0.5) == {0, 1, 2, 3}
    assert survivors(tied, top_p=0.3) == {0}
    assert survivors(log_probs([0.25] * 4), top_k=1) == {0, 1, 2, 3}


def test_temperature_applies_before_masks():
    # At T=2 the probs flatten to ~[.29 .23 .18 .14 .10 .08 .06]: top_p=0.5 now needs three tokens.
    assert survivors(log_probs(PROBS), top_p=0.5, temperature=2.0) == {0, 1, 2}
    # min_p on the sharpened distribution (T=0.5: probs ~ p^2) drops 0.15: 0.0225 < 0.3 * 0.16.
    assert survivors(log_probs(PROBS), min_p=0.3, temperature=0.5) == {0, 1}


def reference_allowed(row: list[float], p: SamplingParams) -> set[int]:
    """Straight from the definitions, in float64 with a full sort."""
    scaled = [x / p.temperature for x in row]
    order = sorted(range(len(row)), key=lambda i: -scaled[i])
    keep = set(range(len(row)))
    if 0 < p.top_k < len(row):
        kth = scaled[order[p.top_k - 1]]
        keep = {i for i in keep if scaled[i] >= kth}
    if p.top_p < 1:
        m = max(scaled[i] for i in keep)
        z = sum(math.exp(scaled[i] - m) for i in keep)
        cum, last = 0.0, None
        for i in order:
            if i in keep:
                cum += math.exp(scaled[i] - m) / z
                last = i
                if cum >= p.top_p:
                    break
        keep = {i for i in keep if scaled[i] >= scaled[last]}
    if p.min_p > 0:
        m = max(scaled)
        keep = {i for i in keep if math.exp(scaled[i] - m) >= p.min_p}
    return keep


def test_masks_match_reference_on_large_vocab():
    # V > 2048 and flat rows (scale 0.1) push the top-p nucleus past both candidate stages to a full sort.
    gen = torch.Generator().manual_seed(7)
    vocab_size = 3000
    cases = [SamplingParams(top_p=0.9), SamplingParams(top_p=0.5, temperature=0.7),
             SamplingParams(top_k=200, top_p=0.95), SamplingParams(top_k=40),
             SamplingParams(min_p=0.05, top_p=0.8), SamplingParams(top_k=2500, top_p=0.99),
             SamplingParams(top_p=0.999, temperature=1.5), SamplingParams()]
    rows, params = [], []
    for scale in (0.1, 1.0, 4.0):
        for p in cases:
            rows.append(torch.randn(vocab_size, generator=gen) * scale)
            params.append(p)
    logits = torch.stack(rows)
    mask = allowed_tokens(logits, params)
    for i, p in enumerate(params):
        got = set(mask[i].nonzero().flatten().tolist())
        assert got == reference_allowed(logits[i].double().tolist(), p), (i, p)


# --- greedy and penalties --------------------------------------------------------------------------------

def test_temperature_zero_is_argmax():
    logits = torch.randn(16, 1000, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(temperature=0.0, top_k=3, top_p=0.5, min_p=0.2)] * 16
    tokens = Sampler()(logits, params, list(range(16)), [0] * 16, [[]] * 16, [[]] * 16)
    assert tokens.dtype == torch.int64
    assert tokens.tolist() == logits.argmax(-1).tolist()


def test_penalties_change_logits_exactly():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 1.0]])
    prompt, output = [[0, 1, 0]], [[1, 3, 3]]

    def penalised(**kw):
        return apply_penalties(logits, [SamplingParams(**kw)], prompt, output)[0].tolist()

    # repetition: every token seen in prompt or output, once; positive logits divided, others multiplied.
    assert penalised(repetition_penalty=2.0) == [1.0, -2.0, 0.5, 1.5, -2.0, 1.0]
    assert penalised(repetition_penalty=0.5) == [4.0, -0.5, 0.5, 6.0, -2.0, 1.0]
    # presence: once per token in the output only (token 0 is prompt-only).
    assert penalised(presence_penalty=0.25) == [2.0, -1.25, 0.5, 2.75, -2.0, 1.0]
    # frequency: times the count in the output.
    assert penalised(frequency_penalty=0.5) == [2.0, -1.5, 0.5, 2.0, -2.0, 1.0]
    assert penalised(frequency_penalty=-0.5) == [2.0, -0.5, 0.5, 4.0, -2.0, 1.0]
    # repetition first, then presence + frequency.
    assert penalised(repetition_penalty=2.0, presence_penalty=0.25, frequency_penalty=0.5) == \
        [1.0, -2.75, 0.5, 0.25, -2.0, 1.0]
    assert penalised() == logits[0].tolist()
    assert logits[0].tolist() == [2.0, -1.0, 0.5, 3.0, -2.0, 1.0]  # the caller's tensor is untouched


def test_penalties_in_a_mixed_batch_touch_only_their_rows():
    logits = torch.tensor([[2.0, -1.0, 0.5], [2.0, -1.0, 0.5], [2.0, -1.0, 0.5]])
    params = [SamplingParams(repetition_penalty=2.0), SamplingParams(), SamplingParams(frequency_penalty=1.0)]
    out = apply_penalties(logits, params, [[0], [0, 1], [1]], [[], [2], [2, 2]])
    assert out.tolist() == [[1.0, -1.0, 0.5], [2.0, -1.0, 0.5], [2.0, -1.0, -1.5]]


def test_greedy_argmax_sees_penalties():
    logits = torch.tensor([[3.0, 2.9, 0.0]])
    sample = Sampler()
    assert sample(logits, [SamplingParams(temperature=0)], [0], [0], [[]], [[0]]).tolist() == [0]
    assert sample(logits, [SamplingParams(temperature=0, repetition_penalty=1.2)], [0], [0], [[]],
                  [[0]]).tolist() == [1]
    assert sample(logits, [SamplingParams(temperature=0, presence_penalty=0.2)], [0], [0], [[]],
                  [[0]]).tolist() == [1]


# --- seeded determinism ----------------------------------------------------------------------------------

TARGET = SamplingParams(temperature=0.8, top_p=0.9, repetition_penalty=1.1, frequency_penalty=0.3, seed=42)
OTHERS = [SamplingParams(temperature=0), SamplingParams(top_k=5), SamplingParams(min_p=0.1, temperature=1.3),
          SamplingParams(presence_penalty=1.0, top_p=0.5),
          SamplingParams(temperature=0.5, top_k=50, top_p=0.8)]


def run_sequence(target_pos: int | None, num_steps: int = 40, vocab_size: int = 4000) -> list[int]:
    """Sample TARGET's tokens step by step, alone (target_pos None) or at target_pos among OTHERS."""
    gen = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, vocab_size, (50,), generator=gen).tolist()
    sample, output = Sampler(), []
    for step in range(num_steps):
        row = torch.randn(vocab_size, generator=gen) * 3  # the model's logits for this sequence
        if target_pos is None:
            logits, params, seeds, steps = row[None], [TARGET], [42], [step]
            prompts, outputs = [prompt], [output]
        else:
            noise = torch.randn(len(OTHERS), vocab_size) * 3  # other rows: anything at all
            logits = torch.cat([noise[:target_pos], row[None], noise[target_pos:]])
            params = OTHERS[:target_pos] + [TARGET] + OTHERS[target_pos:]
            seeds = [torch.randint(0, 2**62, ()).item() for _ in OTHERS]
            seeds.insert(target_pos, 42)
            steps = [torch.randint(0, 100, ()).item() for _ in OTHERS]
            steps.insert(target_pos, step)
            prompts = [list(range(i, i + 10)) for i in range(len(OTHERS))]
            prompts.insert(target_pos, prompt)
            outputs = [[1, 2, 2] for _ in OTHERS]
            outputs.insert(target_pos, output)
        torch.manual_seed(step * 1000 + (target_pos or 0))  # the global RNG must not matter
        output.append(sample(logits, params, seeds, steps, prompts, outputs)[0 if target_pos is None
                                                                              else target_pos].item())
    return output


def test_seeded_row_ignores_the_rest_of_the_batch():
    alone = run_sequence(None)
    assert len(set(alone)) > 10  # really sampling, not stuck on one token
    for pos in (0, 2, len(OTHERS)):
        assert run_sequence(pos) == alone


def test_float32_round_trip_of_params_samples_the_same():
    # The proto carries float32: a decode worker sees 0.699999988..., the colocated engine 0.7.
    logits = torch.randn(64, 3000, generator=torch.Generator().manual_seed(5)) * 2
    sample = Sampler()

    def run(**kw):
        n = len(logits)
        return sample(logits, [SamplingParams(**kw)] * n, list(range(n)), [3] * n, [[1, 2]] * n,
                      [[2, 3]] * n).tolist()

    def f32(x):
        return torch.tensor(x, dtype=torch.float32).item()

    kw = dict(temperature=0.7, top_p=0.9, min_p=0.05, repetition_penalty=1.1, frequency_penalty=0.3)
    assert run(**kw) == run(**{k: f32(v) for k, v in kw.items()})
    assert run(top_p=1 - 1e-12) == run(top_p=1.0)  # float32 1.0: no top-p either way
    sharp = logits * 10
    assert torch.equal(allowed_tokens(sharp, [SamplingParams(top_p=1 - 1e-12)] * len(logits)),
                       allowed_tokens(sharp, [SamplingParams(top_p=1.0)] * len(logits)))
    assert SamplingParams(temperature=1e-5).greedy == SamplingParams(temperature=f32(1e-5)).greedy


def test_seeds_and_steps_change_the_draw():
    logits = torch.zeros(1, 1000)  # uniform: every draw shows in the token
    sample = Sampler()

    def draw(seed, step):
        return sample(logits, [SamplingParams(seed=seed)], [seed], [step], [[]], [[]]).item()

    by_step = [draw(5, n) for n in range(50)]
    assert len(set(by_step)) > 40
    by_seed = [draw(s, 0) for s in range(50)]
    assert len(set(by_seed)) > 40
    assert by_step == [draw(5, n) for n in range(50)]  # and repeatable
    assert len({seeded_uniform(s, n) for s in range(100) for n in range(100)}) == 10_000


def test_empirical_distribution_matches_softmax():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0, -3.0])
    temperature, n = 0.7, 20_000
    probs = torch.softmax(logits / temperature, -1).tolist()
    tokens = Sampler()(logits.expand(n, -1), [SamplingParams(temperature=temperature)] * n,
                       list(range(n)), [0] * n, [[]] * n, [[]] * n)
    counts = torch.bincount(tokens, minlength=len(probs)).tolist()
    chi2 = sum((c - n * p) ** 2 / (n * p) for c, p in zip(counts, probs))
    assert chi2 < 30, (chi2, counts)  # 7 degrees of freedom: p(chi2 > 24.3) = 0.001


def test_empirical_distribution_across_blocks():
    # 1000 tokens: the draw picks a block of 256, then a token in it, and pads the last block.
    logits = torch.linspace(0.0, 3.0, 1000)
    n, num_buckets = 20_000, 8
    probs = torch.softmax(logits, -1).view(num_buckets, -1).sum(-1).tolist()  # buckets straddle blocks
    tokens = Sampler()(logits.expand(n, -1), [SamplingParams()] * n, [11] * n, list(range(n)),
                       [[]] * n, [[]] * n)
    assert 0 <= tokens.min() and tokens.max() < 1000
    counts = torch.bincount(tokens // (1000 // num_buckets), minlength=num_buckets).tolist()
    chi2 = sum((c - n * p) ** 2 / (n * p) for c, p in zip(counts, probs))
    assert chi2 < 30, (chi2, counts)  # 7 degrees of freedom


def test_broken_logits_still_give_a_token_id():
    logits = torch.tensor([[float("nan")] * 300, [float("-inf")] * 300, [float("inf")] + [0.0] * 299])
    tokens = Sampler()(logits, [SamplingParams(top_p=0.9)] * 3, [1, 2, 3], [0, 0, 0], [[]] * 3, [[]] * 3)
    assert all(0 <= t < 300 for t in tokens.tolist())


def test_sampled_tokens_stay_inside_the_mask():
    logits = log_probs(PROBS).expand(2000, -1)
    for kw, allowed in ((dict(top_k=3), {0, 1, 2}), (dict(top_p=0.5), {0, 1}), (dict(min_p=0.5), {0, 1})):
        tokens = Sampler()(logits, [SamplingParams(**kw)] * 2000, list(range(2000)), [7] * 2000,
                           [[]] * 2000, [[]] * 2000)
        assert set(tokens.tolist()) == allowed


def test_bf16_logits_and_empty_batch():
    logits = torch.randn(3, 100).bfloat16()
    params = [SamplingParams(temperature=0), SamplingParams(), SamplingParams(top_k=2)]
    tokens = Sampler()(logits, params, [1, 2, 3], [0, 0, 0], [[]] * 3, [[]] * 3)
    assert tokens.shape == (3,) and tokens.dtype == torch.int64
    assert tokens[0].item() == logits[0].float().argmax().item()
    assert Sampler()(torch.zeros(0, 100), [], [], [], [], []).shape == (0,)


def test_derive_seed():
    assert derive_seed(123) == 123
    drawn = {derive_seed(None) for _ in range(20)}
    assert len(drawn) == 20 and all(0 <= s < 2**63 for s in drawn)


# --- validate --------------------------------------------------------------------------------------------

def test_defaults_and_edges_are_valid():
    SamplingParams().validate(vocab_size=100)
    SamplingParams(temperature=0, top_k=0, top_p=1.0, min_p=1.0, repetition_penalty=10.0,
                   presence_penalty=-2.0, frequency_penalty=2.0, seed=2**63 - 1, max_tokens=1,
                   stop=("x" * MAX_STOP_LEN,) * MAX_STOP_STRINGS, stop_token_ids=(0, 99)).validate(100)
    assert SamplingParams(stop=["a"], stop_token_ids=[1]).stop == ("a",)  # lists become tuples


@pytest.mark.parametrize("field, value", [
    ("temperature", -0.1), ("temperature", float("nan")), ("temperature", float("inf")),
    ("temperature", "1.0"),
    ("top_k", -1), ("top_k", 1.5), ("top_k", True),
    ("top_p", 0.0), ("top_p", 1.5), ("top_p", -0.1), ("top_p", float("nan")),
    ("min_p", -0.01), ("min_p", 1.01), ("min_p", float("nan")),
    ("repetition_penalty", 0.0), ("repetition_penalty", -1.0), ("repetition_penalty", 10.5),
    ("repetition_penalty", float("inf")),
    ("presence_penalty", -2.1), ("presence_penalty", 2.1), ("presence_penalty", float("nan")),
    ("frequency_penalty", -2.1), ("frequency_penalty", 2.1), ("frequency_penalty", float("-inf")),
    ("seed", -1), ("seed", 2**63), ("seed", 1.0),
    ("max_tokens", 0), ("max_tokens", -5),
    ("stop", ("x",) * (MAX_STOP_STRINGS + 1)), ("stop", ("x" * (MAX_STOP_LEN + 1),)), ("stop", ("",)),
    ("stop", "abc"), ("stop", (1,)),
    ("stop_token_ids", (100,)), ("stop_token_ids", (-1,)), ("stop_token_ids", (1.0,)),
    ("ignore_eos", 1),
])
def test_validate_rejects_and_names_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        replace(SamplingParams(), **{field: value}).validate(vocab_size=100)


def test_validate_message_gives_the_range():
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\], got 1.5"):
        SamplingParams(top_p=1.5).validate()


# --- stop strings ----------------------------------------------------------------------------------------

def reference_cut(text: str, stops: list[str]) -> tuple[str, bool]:
    """Text before the stop string that completes first (earliest end, then earliest start)."""
    hits = [(text.find(s) + len(s), text.find(s)) for s in stops if s in text]
    return (text[:min(hits)[1]], True) if hits else (text, False)


def stream(stops: list[str], chunks: list[str]) -> tuple[str, bool]:
    matcher, out, stopped = StopStringMatcher(stops), [], False
    for chunk in chunks:
        emitted, stopped = matcher.feed(chunk)
        out.append(emitted)
        if stopped:
            break
    if not stopped:
        out.append(matcher.flush())
    return "".join(out), stopped


@settings(max_examples=400, deadline=None)
@given(text=st.text(alphabet="ab\n<", max_size=40),
       stops=st.lists(st.text(alphabet="ab\n<", min_size=1, max_size=5), min_size=0, max_size=4),
       cuts=st.lists(st.integers(0, 40), max_size=10))
def test_stop_matcher_is_chunking_invariant(text, stops, cuts):
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    chunks = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    assert stream(stops, chunks) == reference_cut(text, stops)
    if not any(a != b and a in b for a in stops for b in stops):
        # With no stop string inside another, "first" is plainly the earliest occurrence.
        starts = [text.find(s) for s in stops if s in text]
        assert stream(stops, chunks)[0] == (text[:min(starts)] if starts else text)


@settings(max_examples=200, deadline=None)
@given(text=st.text(alphabet="ab<", max_size=30), stops=st.lists(st.text(alphabet="ab<", min_size=1,
                                                                           max_size=4), max_size=3))
def test_stop_matcher_one_char_at_a_time(text, stops):
    assert stream(stops, list(text)) == reference_cut(text, stops)


def test_stop_spanning_chunks_and_hold_back():
    m = StopStringMatcher(["World"])
    assert m.feed("Hello Wor") == ("Hello ", False)  # "Wor" might start the stop string: held
    assert m.feed("ld!") == ("", True)
    assert m.feed("more") == ("", True)
    assert m.flush() == ""


def test_held_text_is_released_when_it_cannot_stop():
    m = StopStringMatcher(["</s>"])
    assert m.feed("a</") == ("a", False)
    assert m.feed("x") == ("</x", False)
    assert m.feed("<") == ("", False)
    assert m.flush() == "<"


def test_stop_at_the_very_start():
    assert StopStringMatcher(["STOP"]).feed("STOP and more") == ("", True)
    m = StopStringMatcher(["ab"])
    assert m.feed("a") == ("", False)
    assert m.feed("b") == ("", True)


def test_overlapping_stop_strings():
    assert stream(["ab", "bc"], ["x", "abc"]) == ("x", True)
    assert stream(["bc", "ab"], ["xa", "bc"]) == ("x", True)
    assert stream(["aab"], list("aaab")) == ("a", True)  # self-overlap: held "aa" slides on by one
    # A stop string inside a longer one: stop as soon as the short one is done, never wait on the long one.
    assert stream(["abcd", "bc"], ["a", "b", "c", "d"]) == ("a", True)
    assert stream(["abc", "bc"], ["xabc"]) == ("x", True)  # same end: the earlier start wins


def test_no_stop_strings_and_bad_ones():
    m = StopStringMatcher([])
    assert m.feed("anything") == ("anything", False)
    assert m.flush() == ""
    with pytest.raises(ValueError):
        StopStringMatcher([""])
    with pytest.raises(ValueError):
        StopStringMatcher("abc")
