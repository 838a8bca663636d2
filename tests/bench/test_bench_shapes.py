"""bench/shapes.py's own parts: what its figures stand on must hold before the figures mean anything."""
from __future__ import annotations

import torch

from bench.shapes import CONTEXT, OursStreams, prompt_ids


def test_streams_with_a_copied_context_decode_what_one_stream_prefilled_alone_decodes(make_runner):
    """The decode figures give every stream the K/V of one prefilled prompt, copied in the cache: each stream
    must then decode exactly what a stream whose own prompt was prefilled decodes (and all the same tokens,
    since the packed decode rows do not depend on the batch)."""
    runner = make_runner(num_blocks=256, dtype=torch.bfloat16, packed_decode=True)
    ids = prompt_ids(CONTEXT, runner.model.config.vocab_size)
    alone = OursStreams(runner, ids, 1, 8)
    want = [alone.next[0]]
    for _ in range(6):
        alone.steps(1)
        want.append(alone.next[0])
    alone.close()
    streams = OursStreams(runner, ids, 5, 8)
    got = [streams.next]
    for _ in range(6):
        streams.steps(1)
        got.append(streams.next)
    streams.close()
    assert all(step == [w] * 5 for step, w in zip(got, want)), (got, want)
    assert runner.cache.pool.num_used_blocks == 0


def test_prompt_ids_are_ordinary_tokens_the_same_for_both_systems():
    a, b = prompt_ids(512, 49152, seed=3), prompt_ids(512, 49152, seed=3)
    assert a == b and len(a) == 512 and all(1000 <= t < 32000 for t in a)
    assert all(t < 20000 for t in prompt_ids(64, 20000))
