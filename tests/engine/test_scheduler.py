"""The Scheduler alone, on a real BlockPool and no model: which prompt chunk runs next (shortest first,
never starving a long one; the colocated token budget), admission that waits for room and never
allocates in part, preemption of the newest, the replay-row budget of a decode step, and parking."""
from __future__ import annotations

import pytest

from common.engine.config import EngineConfig
from common.engine.kv_cache import BlockPool
from common.engine.prefix import PrefixHasher
from common.engine.sampling import SamplingParams
from common.engine.scheduler import Parked, Scheduler
from common.engine.sequence import Sequence

BLOCK = 4
CHUNK = 8


def make_scheduler(num_blocks: int = 64, **config) -> Scheduler:
    config = EngineConfig(prefill_chunk_tokens=CHUNK, **config)
    hasher = PrefixHasher(weights_id="test", dtype="fp32", block_size=BLOCK, chunk_tokens=CHUNK)
    return Scheduler(config, BlockPool(num_blocks, BLOCK), hasher)


def make_seq(seq_id: str, prompt_len: int, output_len: int = 0, **kw) -> Sequence:
    # Distinct tokens per sequence: no prompt shares another's prefix (no prefix-cache hit) unless a test says.
    base = 1000 * (1 + sum(map(ord, seq_id)))
    return Sequence(seq_id, list(range(base, base + prompt_len)), SamplingParams(), 0, lambda ev: None, None,
                    output_ids=list(range(7, 7 + output_len)), **kw)


def add(sched: Scheduler, *seqs: Sequence) -> None:
    for seq in seqs:
        assert sched.add(seq) is None


def prefill_all(sched: Scheduler) -> None:
    """What the engine does with a prefill pass, without the model: every planned chunk is computed, and a
    new sequence whose prompt is done samples its first token."""
    sched.admit()
    while chunks := sched.schedule_prefill():
        for chunk in chunks:
            sched.chunk_done(chunk)
            if chunk.last and not chunk.seq.output_ids:
                chunk.seq.output_ids.append(1)


def test_a_prefill_worker_runs_the_shortest_prompt_first_and_a_passed_over_one_within_the_bound():
    # max_prefill_tokens / chunk = 2: a prompt passed over for two chunks in a row runs next.
    sched = make_scheduler(prefill_only=True, max_prefill_tokens=2 * CHUNK)
    add(sched, make_seq("long", 5 * CHUNK))
    sched.admit()
    first = sched.schedule_prefill()
    assert [(c.seq.seq_id, c.start, c.end) for c in first] == [("long", 0, CHUNK)]
    sched.chunk_done(first[0])
    add(sched, *(make_seq(name, CHUNK - 3) for name in ("s1", "s2", "s3")))
    sched.admit()
    order = []
    while sched.prefilling:
        chunks = sched.schedule_prefill()
        assert len(chunks) == 1, "prefill_only runs one chunk a step"
        chunk = chunks[0]
        assert chunk.start == chunk.seq.num_computed and chunk.start % CHUNK == 0  # fixed positions
        sched.chunk_done(chunk)
        order.append(chunk.seq.seq_id)
        if chunk.last:
            sched.remove(chunk.seq)  # the engine finishes it with its first token
        sched.check_integrity()
    # s1 and s2 are shorter; then the long one, passed over twice, before s3.
    assert order == ["s1", "s2", "long", "s3", "long", "long", "long"], order
    assert sched.pool.num_free_blocks == sched.pool.num_blocks


def test_a_colocated_prefill_pass_runs_chunks_oldest_first_up_to_the_token_budget():
    sched = make_scheduler(max_prefill_tokens=2 * CHUNK)
    add(sched, make_seq("a", 2 * CHUNK + 4), make_seq("b", 2 * CHUNK + 4))
    sched.admit()
    first = sched.schedule_prefill()
    assert [(c.seq.seq_id, c.start, c.end) for c in first] == [("a", 0, 8), ("a", 8, 16)]
    assert sched.schedule_prefill() == first  # until its chunks are done, the plan stands
    for chunk in first:
        sched.chunk_done(chunk)
    # a's last 4 tokens, then b's chunks until the budget is spent (the chunk that crosses it still runs).
    second = [(c.seq.seq_id, c.start, c.end) for c in sched.schedule_prefill()]
    assert second == [("a", 16, 20), ("b", 0, 8), ("b", 8, 16)], second
    # A budget below one chunk still runs one chunk.
    small = make_scheduler(max_prefill_tokens=1)
    add(small, make_seq("a", 2 * CHUNK))
    small.admit()
    assert [(c.start, c.end) for c in small.schedule_prefill()] == [(0, CHUNK)]


def test_admission_waits_while_the_pool_is_full_and_never_allocates_in_part():
    sched = make_scheduler(num_blocks=10)  # 40 tokens
    a, b, c = make_seq("a", 20), make_seq("b", 20), make_seq("c", 3)  # 21 tokens = 6 blocks; 4 tokens = 1
    add(sched, a, b, c)
    admission = sched.admit()
    assert admission.admitted == [a] and not admission.refused
    # b needs 6 blocks, 4 are free: it waits with nothing allocated, and c, queued behind it, waits too.
    assert list(sched.waiting) == [b, c]
    assert not sched.pool.holds("b") and not sched.pool.holds("c")
    assert sched.pool.num_free_blocks == 4 and b.num_computed == 0
    sched.check_integrity()
    assert sched.admit().admitted == []  # asking again changes nothing
    assert sched.pool.num_free_blocks == 4
    sched.remove(a)
    assert sched.admit().admitted == [b, c]
    assert not sched.waiting and sched.prefilling == [b, c]
    sched.check_integrity()


def test_a_sequence_larger_than_the_whole_pool_is_refused_and_does_not_block_the_queue():
    sched = make_scheduler(num_blocks=10)
    big, small = make_seq("big", 40), make_seq("small", 3)
    add(sched, big, small)
    admission = sched.admit()
    assert [(s, "41 tokens needs 11 KV blocks" in why) for s, why in admission.refused] == [(big, True)]
    assert admission.admitted == [small]
    assert not sched.pool.holds("big")


def test_on_shortage_the_newest_running_sequence_is_preempted():
    # Three prompts of 8 tokens take 3 blocks each (room for the first token), the whole pool. At 13 tokens
    # each needs a 4th block: the newest gives its blocks up, so the two older ones keep going.
    sched = make_scheduler(num_blocks=9)
    seqs = [make_seq(name, 8) for name in ("a", "b", "c")]
    add(sched, *seqs)
    prefill_all(sched)
    assert sched.running == seqs and sched.pool.num_free_blocks == 0
    preempted = []
    for _ in range(8):
        rows, preempted = sched.schedule_decode()
        if preempted:
            break
        for r in rows:
            if r.sample:
                r.seq.output_ids.append(1)
    a, b, c = seqs
    assert preempted == [c], [s.seq_id for s in preempted]
    assert sched.running == [a, b] and list(sched.waiting) == [c]
    assert not sched.pool.holds("c") and c.num_computed == 0 and len(c.output_ids) == 5  # tokens kept
    assert [len(sched.pool.block_table(s.seq_id)) for s in (a, b)] == [4, 4]
    assert [r.seq for r in rows] == [a, b] and all(r.sample for r in rows)
    sched.check_integrity()


def test_replayed_rows_of_a_decode_step_stay_within_max_replay_rows():
    # a and b resume (their completions' K/V is replayed after their prompts' prefill); c decodes normally.
    sched = make_scheduler(max_replay_rows=8)
    a, b, c = make_seq("a", 4, output_len=20), make_seq("b", 4, output_len=6), make_seq("c", 4)
    add(sched, a, b, c)
    prefill_all(sched)
    assert sched.running == [a, b, c] and a.num_computed == b.num_computed == 4
    steps = []
    for _ in range(3):
        rows, _ = sched.schedule_decode()
        steps.append({r.seq.seq_id: (r.end - r.start, r.sample) for r in rows})
        assert sum(r.end - r.start - r.sample for r in rows) <= 8  # replayed rows, the sampled ones aside
        for r in rows:
            if r.sample:
                r.seq.output_ids.append(1)
    # a replays 19 tokens: 8, 8, then its last 3 and its newest; b's 5 wait for budget a leaves; c always
    # gets its row.
    assert steps == [{"a": (8, False), "b": (0, False), "c": (1, True)},
                     {"a": (8, False), "b": (0, False), "c": (1, True)},
                     {"a": (4, True), "b": (6, True), "c": (1, True)}], steps


def test_parked_kv_is_admitted_only_when_it_fits_and_is_checked_against_its_prompt():
    sched = make_scheduler(num_blocks=6)
    assert sched.park_refusal("p", [], 20) is None
    assert sched.park("p", [], 20) == 0
    assert sched.parked["p"] == Parked(20, sched.parked["p"].parked_s, [])
    assert sched.park_refusal("p", [], 4).code == "duplicate"
    assert sched.park_refusal("q", [], 8).code == "no_room"  # 1 block free, 2 needed
    assert sched.park_refusal("q", [], 25).code == "too_big"
    assert sched.park_refusal("q", [b"\0" * 16], 4).code == "evicted"
    assert sched.pool.num_free_blocks == 1 and sched.num_active == 1  # refusals changed nothing
    wrong = make_seq("p", 21, parked=True)
    assert "holds 20 tokens, the prompt has 21" in sched.add(wrong)
    assert not sched.parked and sched.pool.num_free_blocks == 6  # freed with the refusal
    sched.park("p", [], 20)
    right = make_seq("p", 20, output_len=1, parked=True)
    add(sched, right)
    assert sched.admit().admitted == [right] and sched.running == [right] and right.num_computed == 20
    sched.check_integrity()


@pytest.mark.parametrize("cached", [False, True])
def test_a_prompt_reuses_the_whole_chunks_the_pool_holds(cached):
    sched = make_scheduler(prefix_caching=cached)
    first = make_seq("first", 2 * CHUNK + 3)
    add(sched, first)
    prefill_all(sched)
    sched.remove(first)
    again = make_seq("again", 0)
    again.prompt_ids = first.prompt_ids + [5]
    add(sched, again)
    sched.admit()
    assert again.num_cached == (2 * CHUNK if cached else 0)
    assert sched.num_cached_tokens == again.num_cached
    sched.check_integrity()
