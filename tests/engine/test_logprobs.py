"""Logprobs from the engine: HF transformers' fp32 log-softmax on the same weights within 1e-4, for the
first token (prefill) and decode tokens, greedy and sampled; tokens unchanged by asking for them;
nothing computed when nobody asks."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from common.engine.model import Llama
from common.engine.runner import PrefillItem
from common.engine.sampling import SamplingParams, token_logprobs
from tests.support.engine import CHAT_QUESTION, Sinks, run_until_done

N = 8
TOL = 1e-4
GREEDY = SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True, logprobs=5)
# A sampled request: logprobs are the model's, before temperature, top-p and penalties.
SAMPLED = SamplingParams(temperature=1.3, top_p=0.9, repetition_penalty=1.3, presence_penalty=0.5, seed=7,
                         max_tokens=N, ignore_eos=True, logprobs=20)


def run(engine, requests: dict[str, tuple[list[int], SamplingParams]]) -> Sinks:
    sinks = Sinks()
    for seq_id, (ids, params) in requests.items():
        engine.submit(seq_id, ids, params, sinks.sink(seq_id))
    run_until_done(engine, sinks)
    engine.check_integrity()
    assert engine.pool.num_free_blocks == engine.pool.num_blocks
    return sinks


def logprobs_of(collected) -> list:
    out = [lp for e in collected.events for lp in (e.logprobs or [])]
    assert len(out) == len(collected.token_ids), "one logprobs entry per token"
    return out


def hf_log_softmax(hf, prompt_ids: list[int], output_ids: list[int]) -> torch.Tensor:
    """HF's fp32 log-softmax at the positions that predicted each output token: [len(output_ids), V]."""
    ids = torch.tensor([prompt_ids + output_ids[:-1]])
    with torch.inference_mode():
        logits = hf(ids, attention_mask=torch.ones_like(ids)).logits[0].float()
    return torch.log_softmax(logits[len(prompt_ids) - 1:], dim=-1)


def assert_matches(ours: list, ref: torch.Tensor, output_ids: list[int], k: int) -> float:
    """Each token's logprob and its top-k (ids and values) against HF's row; returns the largest difference."""
    worst = 0.0
    for pos, (lp, tok) in enumerate(zip(ours, output_ids)):
        row = ref[pos]
        assert lp.token_id == tok
        worst = max(worst, abs(lp.logprob - row[tok].item()))
        assert len(lp.top) == k
        values = [v for _, v in lp.top]
        assert values == sorted(values, reverse=True)
        for t, v in lp.top:
            worst = max(worst, abs(v - row[t].item()))
        # Our top-k is HF's top-k, up to ties closer than the tolerance at the k-th place.
        kth_ref = row.topk(k + 1).values
        assert values[-1] >= kth_ref[k - 1].item() - TOL and values[-1] + TOL >= kth_ref[k].item()
        assert {t for t, _ in lp.top} >= {t for t, v in zip(row.topk(k).indices.tolist(), kth_ref.tolist())
                                           if v > kth_ref[k].item() + TOL}
    assert worst < TOL, f"largest |ours - HF| = {worst:.2e}"
    return worst


def test_logprobs_match_hf_fp32(make_engine, hf_smollm2, chat_ids, smollm2_tokenizer):
    """Dense fp32: the first token's (prefill) and every decode token's logprob and top alternatives are
    HF's log-softmax within 1e-4, greedy and sampled (where temperature and penalties change the draw,
    not the reported values), in one batch."""
    prompts = {"chat": chat_ids(CHAT_QUESTION), "text": smollm2_tokenizer.encode("Once upon a time,")}
    requests = {f"{kind}-{name}": (ids, params) for name, ids in prompts.items()
                for kind, params in (("greedy", GREEDY), ("sampled", SAMPLED))}
    sinks = run(make_engine(num_blocks=64), requests)
    for seq_id, (ids, params) in requests.items():
        out = sinks[seq_id].token_ids
        assert_matches(logprobs_of(sinks[seq_id]), hf_log_softmax(hf_smollm2, ids, out), out, params.logprobs)
    greedy = logprobs_of(sinks["greedy-chat"])
    assert all(lp.top[0][0] == lp.token_id for lp in greedy), "greedy picks the most likely token"
    sampled = logprobs_of(sinks["sampled-text"])
    assert any(lp.top[0][0] != lp.token_id for lp in sampled), "the sampled request never left the argmax"


def test_the_int8_decode_head_alone_would_miss_1e4(make_runner, smollm2_tokenizer):
    """Why the normaliser is computed in fp32: the decode logits' int8 tail moves logsumexp past the
    tolerance (so a test of the exact path can fail when it is not taken)."""
    runner = make_runner(num_blocks=16)
    ids = smollm2_tokenizer.encode("Once upon a time, in a land far away, there lived a")
    runner.cache.pool.allocate("x", len(ids))
    runner.prefill([PrefillItem("x", ids)])
    runner.cache.pool.free("x")
    hidden = runner.last_hidden
    exact = runner.model.log_probs(hidden)
    approx = torch.log_softmax(runner.model.decode_logits(hidden.clone()), dim=-1)
    top = exact.topk(20, dim=-1).indices
    assert (exact.gather(1, top) - approx.gather(1, top)).abs().max().item() > TOL


@pytest.mark.parametrize("config", [dict(dtype=torch.float32, packed_decode=True), dict(dtype=torch.float32),
                                    dict(dtype=torch.bfloat16, packed_decode=True)],
                         ids=["fp32+int4", "fp32", "bf16+int4"])
def test_asking_for_logprobs_changes_no_token(make_engine, chat_ids, smollm2_tokenizer, config):
    """Greedy and seeded requests give the same tokens with and without logprobs, batched together."""
    ids = {"a": chat_ids(CHAT_QUESTION), "b": smollm2_tokenizer.encode("def add(a, b):\n    return")}
    requests = {f"{name}-{kind}": (p, params) for name, p in ids.items()
                for kind, params in (("greedy", GREEDY), ("sampled", SAMPLED))}
    with_lp = run(make_engine(num_blocks=64, **config), requests)
    without = run(make_engine(num_blocks=64, **config),
                  {k: (p, replace(params, logprobs=None)) for k, (p, params) in requests.items()})
    for seq_id in requests:
        assert with_lp[seq_id].token_ids == without[seq_id].token_ids, seq_id
        assert all(e.logprobs is None for e in without[seq_id].events)
        for lp in logprobs_of(with_lp[seq_id]):
            assert lp.logprob <= 0 and all(v <= 0 for _, v in lp.top)


def test_prefill_only_engine_hands_back_the_first_tokens_logprobs(make_engine, chat_ids):
    """What a prefill worker returns with FirstToken: the same values a colocated engine gives it."""
    ids = chat_ids(CHAT_QUESTION)
    prefilled = run(make_engine(num_blocks=16, prefill_only=True), {"p": (ids, GREEDY)})["p"]
    colocated = run(make_engine(num_blocks=16), {"c": (ids, replace(GREEDY, max_tokens=1))})["c"]
    assert prefilled.kv is not None
    assert logprobs_of(prefilled) == logprobs_of(colocated)


def test_no_logprobs_work_unless_asked(make_engine, chat_ids, monkeypatch):
    def refuse(self, hidden):
        raise AssertionError("log_probs computed for a request that did not ask")

    monkeypatch.setattr(Llama, "log_probs", refuse)
    sinks = run(make_engine(num_blocks=16), {"x": (chat_ids(CHAT_QUESTION), replace(GREEDY, logprobs=None))})
    assert len(sinks["x"].token_ids) == N


def test_token_logprobs_picks_rows_and_top_k():
    log_probs = torch.log_softmax(torch.tensor([[1.0, 3.0, 2.0, 0.0], [0.0, 0.0, 5.0, 1.0]]), dim=-1)
    a, b = token_logprobs(log_probs, [0, 2], [2, 0])
    assert a.token_id == 0 and a.logprob == pytest.approx(log_probs[0, 0].item())
    assert [t for t, _ in a.top] == [1, 2] and b.top == ()
    with pytest.raises(ValueError, match="top_logprobs"):
        SamplingParams(logprobs=21).validate()
