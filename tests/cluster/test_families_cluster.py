"""Every model family through an in-process cluster (prefill worker -> KV push -> decode worker), in the
file type people download (Q4_K_M) and the default dtype, one prefill worker:

- greedy through the cluster gives the tokens of the same model decoded by an engine alone;
- a seeded sampled request gives the same tokens alone and inside a batch of others (invariant 4: same
  inputs, same tokens), and again on a rerun;
- and in fp32 from the F32 GGUF, greedy through the cluster equals HF transformers' greedy on the same
  weights, up to the first position where HF's two best logits are closer than the fp32 noise.
"""
from __future__ import annotations

import grpc
import pytest
import torch

from common.engine.engine import Engine, EngineConfig
from common.engine.kv_cache import KVCache
from common.engine.runner import ModelRunner
from common.engine.sampling import SamplingParams
from common.worker import WorkerConfig
from protos import handoff_pb2, handoff_pb2_grpc
from router.cluster import Cluster
from tests.support.cluster import wait_idle
from tests.support.engine import Sinks, run_until_done
from bench.zoo import ARCHS
from tests.support.zoo import family_files, hf_reading_the_gguf  # noqa: F401 (a fixture)

PROMPT = "Tell me a long story about a fox who learns to sail across the northern sea"
MAX_TOKENS = 24


def generate(cluster, **fields) -> list[int]:
    with grpc.insecure_channel(cluster.address) as ch:
        stub = handoff_pb2_grpc.RouterStub(ch)
        request = handoff_pb2.GenerateRequest(prompt=PROMPT, max_tokens=MAX_TOKENS, ignore_eos=True, **fields)
        return [t for msg in stub.Generate(request, timeout=120) for t in msg.token_ids]


def generate_many(cluster, requests: list[dict]) -> list[list[int]]:
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(len(requests)) as pool:
        return list(pool.map(lambda fields: generate(cluster, **fields), requests))


@pytest.fixture(scope="module", params=ARCHS)
def family_cluster(request, family_files):  # noqa: F811
    model = family_files(request.param)["Q4_K_M"]
    c = Cluster(model=str(model), num_prefill=1, num_decode=1, kv_memory_gib=0.1, threads=1).start()
    yield request.param, c
    c.stop()


def test_greedy_through_the_cluster_is_the_engine_alone(family_cluster):
    arch, cluster = family_cluster
    got = generate(cluster, temperature=0.0)
    model, tokenizer = cluster.decode[0].engine.runner.model, cluster.decode[0].tokenizer
    engine = Engine(ModelRunner(model, KVCache(model.config, 64, 16, model.dtype)), tokenizer, EngineConfig())
    ids = tokenizer.encode(PROMPT)
    sinks = Sinks()
    engine.submit("alone", ids, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
                  sinks.sink("alone"))
    run_until_done(engine, sinks)
    assert got == sinks["alone"].token_ids, f"{arch}: the cluster's greedy tokens are not the engine's"
    wait_idle(cluster)


def test_seeded_sampling_is_the_same_alone_and_in_a_batch(family_cluster):
    arch, cluster = family_cluster
    seeded = dict(temperature=1.0, top_p=0.95, seed=11)
    alone = generate(cluster, **seeded)
    batch = generate_many(cluster, [seeded, dict(temperature=0.8, seed=12), dict(temperature=0.0),
                                    dict(temperature=1.0, seed=13), seeded])
    assert batch[0] == alone and batch[4] == alone, f"{arch}: a seeded request's tokens changed with its company"
    assert generate(cluster, **seeded) == alone
    wait_idle(cluster)


def _equal_until_a_near_tie(ours: list[int], hf_logits: torch.Tensor, hf_ids: list[int], margin: float) -> int:
    """How many tokens agree before the first difference; a difference must sit where HF's two best logits
    are within `margin` (fp32 rounding may order them either way)."""
    for i, (a, b) in enumerate(zip(ours, hf_ids)):
        if a != b:
            top2 = hf_logits[i].topk(2).values
            assert (top2[0] - top2[1]).item() < margin, f"token {i}: ours {a}, HF {b}, not a near-tie"
            return i
    return len(ours)


@pytest.mark.parametrize("arch", ARCHS)
def test_fp32_greedy_through_the_cluster_is_hf(arch, family_files):  # noqa: F811
    files = family_files(arch)
    c = Cluster(model=str(files["F32"]), num_prefill=1, num_decode=1, kv_memory_gib=0.1, threads=1,
                dtype="fp32", worker=WorkerConfig(role="prefill")).start()
    try:
        got = generate(c, temperature=0.0)
        prompt_ids = c.decode[0].tokenizer.encode(PROMPT)
    finally:
        c.stop()
    hf = hf_reading_the_gguf(files)
    from transformers import GenerationConfig
    config = GenerationConfig(do_sample=False, max_new_tokens=MAX_TOKENS, eos_token_id=[], pad_token_id=0,
                              output_scores=True, return_dict_in_generate=True)
    with torch.inference_mode():
        input_ids = torch.tensor([prompt_ids])
        out = hf.generate(input_ids, attention_mask=torch.ones_like(input_ids), generation_config=config)
    hf_ids = out.sequences[0, len(prompt_ids):].tolist()
    agreed = _equal_until_a_near_tie(got, torch.stack(out.scores)[:, 0], hf_ids, margin=1e-3)
    assert agreed >= 8, f"{arch}: only {agreed} tokens before a near-tie"
