"""Sampling settings a model's files carry fill a request's unset fields (--generation-config auto); none turns
that off; router.cluster's one-shot answer has a gentler demo default, said aloud."""
from __future__ import annotations

import argparse
import json
import logging
from dataclasses import replace
from pathlib import Path

import gguf
import grpc
import pytest
from gguf.scripts.gguf_new_metadata import MetadataDetails, copy_with_new_metadata

from common.engine.generation_config import sampling_defaults
from common.engine.model_files import resolve_model_path
from common.engine.tokenizer import load_tokenizer
from common.engine.weights import read_model_config
from protos import handoff_pb2, handoff_pb2_grpc
from router import cluster as cluster_cli
from router.cluster import Cluster
from router.config import RouterConfig
from router.validate import RequestValidator


def test_hf_generation_config_fills_what_it_sets_and_leaves_out_what_is_invalid(tmp_path, caplog):
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 1.5,
         "repetition_penalty": 1.1, "max_new_tokens": 64, "bos_token_id": 1}))
    with caplog.at_level(logging.WARNING):
        found = sampling_defaults(tmp_path)
    assert found == {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "repetition_penalty": 1.1, "max_tokens": 64}
    assert "min_p = 1.5" in caplog.text
    (tmp_path / "generation_config.json").unlink()
    assert sampling_defaults(tmp_path) == {}


def _gguf_with(tmp_path: Path, values: dict) -> Path:
    """The default model's GGUF, copied with general.sampling.* keys added."""
    source = resolve_model_path("smollm2")
    out = tmp_path / "with-sampling.gguf"
    reader = gguf.GGUFReader(source)
    arch = reader.get_field(gguf.Keys.General.ARCHITECTURE).contents()
    writer = gguf.GGUFWriter(out, arch=arch, endianess=reader.endianess)
    kinds = {float: gguf.GGUFValueType.FLOAT32, int: gguf.GGUFValueType.INT32}
    copy_with_new_metadata(reader, writer, {k: MetadataDetails(kinds[type(v)], v) for k, v in values.items()}, [])
    return out


@pytest.fixture(scope="module")
def sampling_gguf(tmp_path_factory):
    return _gguf_with(tmp_path_factory.mktemp("gguf"), {"general.sampling.temp": 0.0,
                                                        "general.sampling.top_k": 7})


def test_gguf_sampling_keys(sampling_gguf):
    assert sampling_defaults(sampling_gguf) == {"temperature": 0.0, "top_k": 7}
    assert sampling_defaults(resolve_model_path("smollm2")) == {}, "the default model's file carries none"


def test_defaults_fill_only_unset_fields():
    path = resolve_model_path("smollm2")
    validator = RequestValidator(load_tokenizer(path), read_model_config(path), default_max_tokens=256,
                                 max_messages=8, sampling_defaults={"temperature": 0.0, "top_k": 7, "max_tokens": 5})
    unset = validator.validate(handoff_pb2.GenerateRequest(prompt="Hello"))
    assert (unset.params.temperature, unset.params.top_k, unset.params.max_tokens) == (0.0, 7, 5)
    assert unset.params.top_p == 1.0, "a field the files do not set keeps handoff's default"
    given = validator.validate(handoff_pb2.GenerateRequest(prompt="Hello", temperature=0.8, top_k=0, max_tokens=9))
    assert (given.params.temperature, given.params.top_k, given.params.max_tokens) == (pytest.approx(0.8), 0, 9)
    plain = RequestValidator(load_tokenizer(path), read_model_config(path), default_max_tokens=256, max_messages=8)
    assert plain.validate(handoff_pb2.GenerateRequest(prompt="Hello")).params.temperature == 1.0


def test_a_router_serving_the_file_samples_with_its_settings(sampling_gguf):
    """Through the cluster: the file says temperature 0, so an unset request is greedy (equal to an explicit
    temperature 0) with auto, and sampled (it differs from greedy for some seed) with none."""
    with Cluster(model=str(sampling_gguf), http_port=-1, kv_memory_gib=0.25) as c:
        assert c.router.sampling_defaults == {"temperature": 0.0, "top_k": 7}
        greedy = generate_ids(c, prompt="Once upon a time", max_tokens=12, temperature=0.0)
        assert generate_ids(c, prompt="Once upon a time", max_tokens=12, seed=3) == greedy
    with Cluster(model=str(sampling_gguf), http_port=-1, kv_memory_gib=0.25,
                 router=replace(RouterConfig(), generation_config="none")) as c:
        assert c.router.sampling_defaults == {}
        sampled = [generate_ids(c, prompt="Once upon a time", max_tokens=12, seed=seed) for seed in range(3)]
        assert any(ids != greedy for ids in sampled), "with none, an unset temperature is 1.0 (sampled)"


def generate_ids(cluster, **fields) -> list[int]:
    with grpc.insecure_channel(cluster.address) as channel:
        replies = handoff_pb2_grpc.RouterStub(channel).Generate(handoff_pb2.GenerateRequest(**fields), timeout=60)
        return [t for r in replies for t in r.token_ids]


def _args(**given) -> argparse.Namespace:
    fields = {name: None for name in ("temperature", "top_p", "top_k", "min_p")}
    return argparse.Namespace(**{**fields, **given})


def test_the_demo_default_applies_only_where_nothing_else_does():
    args = _args()
    said = cluster_cli.demo_sampling(args, {})
    assert (args.temperature, args.top_p) == (0.2, 0.9) and "demo default" in said
    args = _args(temperature=1.0)
    assert cluster_cli.demo_sampling(args, {}) == "as the command line sets it" and args.top_p is None
    args = _args()
    assert "model's own" in cluster_cli.demo_sampling(args, {"temperature": 0.6}) and args.temperature is None
