"""The engine benchmark's decode bound: the memory's speed is measured in turn with the 1-stream steps it
bounds, one pass a round, and each fraction says which bandwidth it divides by."""
from __future__ import annotations

import json
import time

import pytest

from bench import engine
from bench.bandwidth import ReadBandwidth


def test_the_bound_is_taken_at_bandwidth_passes_in_turn_with_the_steps(capsys, bench_systems):
    dtype, ours, hf = bench_systems
    bandwidth = ReadBandwidth(16 << 20)
    passes_before = bandwidth.num_passes
    layers_before = list(ours.model.native_layers or ())
    steps = 3
    engine.bench_decode(ours, hf, [1], steps=steps, warmup=1, bandwidth=bandwidth, dtype=dtype)
    recs = {r["name"]: r for r in map(json.loads, capsys.readouterr().out.splitlines())}

    in_turn, best = recs["memory_read_bandwidth_in_turn"], recs["memory_read_bandwidth"]
    # One pass a round of the rotation (plus the warm-up one, and two after the batch size), all counted
    # towards the best pass as well; the median pass cannot beat the best one.
    assert in_turn["passes"] == steps
    assert bandwidth.num_passes - passes_before == steps + 1 + 2 == best["passes"]
    assert 0 < in_turn["value"] <= best["value"] == pytest.approx(in_turn["best_pass_gbs"])
    # The bandwidth loop is not a decode figure.
    assert not [n for n in recs if "bandwidth" in n and n.startswith("decode_tok_s")]

    tok_s = recs["decode_tok_s_1seq"]["value"]
    kv = ours.runner.cache.kv  # [layers, slots, 2, kv_heads, head_dim]
    context = engine.CHAT_PROMPT_LEN + 1 + steps // 2  # the measured steps' median position
    for name, label in ((f"{dtype}_weights", dtype), ("read_weights", "read"), ("step", "step")):
        bound = recs[f"decode_1seq_bound_{name}"]
        nbytes = bound["weight_bytes"] + bound["kv_bytes"]
        assert bound["value"] == pytest.approx(in_turn["value"] * 1e9 / nbytes, rel=2e-3)
        assert bound["best_pass_bound"] == pytest.approx(best["value"] * 1e9 / nbytes, rel=2e-3)
        frac, frac_best = (recs[f"decode_1seq_fraction_of_bound_{label}{s}"] for s in ("", "_best_pass"))
        assert frac["value"] == pytest.approx(tok_s / bound["value"], rel=2e-3)
        assert frac_best["value"] == pytest.approx(tok_s / bound["best_pass_bound"], rel=2e-3)
        assert frac_best["value"] <= frac["value"] * (1 + 2e-3)
        assert "median pass in turn" in frac["unit"] and "best pass" in frac_best["unit"]
        # The 0.6 target is on every byte a step reads: the weights decode reads, and the sequence's K/V.
        assert ("target" in frac) == (name == "step")
    step, read = recs["decode_1seq_bound_step"], recs["decode_1seq_bound_read_weights"]
    assert step["weight_bytes"] == read["weight_bytes"] and read["kv_bytes"] == 0
    assert step["kv_bytes"] == context * kv.shape[0] * 2 * kv.shape[3] * kv.shape[4] * kv.element_size() > 0

    # The loop with every layer on layer 0's weights gives the model its own layers back, and its figure is
    # set against the runner's of the same rotation.
    assert list(ours.model.native_layers or ()) == layers_before
    cached = recs.get("decode_1seq_runner_cached_layers_tok_s")
    assert (cached is not None) == engine.CachedLayersDecode.applies(ours)
    if cached is not None:
        runner = recs["decode_runner_tok_s_1seq"]["value"]
        assert cached["runner_tok_s"] == runner
        assert cached["runner_fraction"] == pytest.approx(runner / cached["value"], rel=2e-3)
        assert 0 < cached["layer_weight_bytes"] < step["weight_bytes"]


def test_a_bandwidth_pass_is_followed_by_its_settle_step_outside_its_timing():
    calls = []

    def settle():
        calls.append(len(calls))
        time.sleep(0.2)  # far longer than a pass over 1 MiB

    passes = engine.BandwidthPasses(ReadBandwidth(1 << 20), settle=settle)
    seconds = passes.steps(3)
    assert calls == [0, 1, 2]
    assert len(seconds) == 3 and all(0 < s < 0.2 for s in seconds)
