"""The name the OpenAI API serves the model under (--served-model-name): derived from the model when unset
(a short name as it is, a .gguf file's stem, an HF folder's name), listed by /v1/models, the only
accepted `model` (the path is not one), and what responses report; several names, comma-separated,
all accepted, the first reported. Against a real in-process cluster started with --model a file path,
driven by the unmodified `openai` client."""
from __future__ import annotations

from dataclasses import replace

import openai
import pytest

from common.engine.gguf_weights import open_gguf
from common.engine.model_files import resolve_model_path, served_name
from router.cluster import Cluster
from router.config import RouterConfig
from router.server import RouterServer

PROMPT = "The quick brown fox"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
GGUF = resolve_model_path("smollm2")  # .../SmolLM2-135M-Instruct.Q4_1.gguf
DERIVED = "SmolLM2-135M-Instruct.Q4_1"


# --------------------------------------------------------------------------- the name, without a cluster


def test_short_name_is_served_as_it_is():
    assert served_name("smollm2") == "smollm2"


def test_gguf_file_is_served_under_its_stem_not_its_general_name():
    general_name = open_gguf(GGUF).fields["general.name"]
    assert served_name(GGUF) == served_name(str(GGUF)) == DERIVED
    assert general_name != DERIVED, "the file's general.name is free text, not the name chosen here"
    assert served_name("models/Llama-3.2-1B-Instruct-Q4_K_M.GGUF") == "Llama-3.2-1B-Instruct-Q4_K_M"


def test_hf_folder_is_served_under_its_name(tmp_path, monkeypatch):
    folder = tmp_path / "SmolLM2-135M-Instruct.v2"
    folder.mkdir()
    assert served_name(folder) == served_name(f"{folder}/") == "SmolLM2-135M-Instruct.v2"
    monkeypatch.chdir(folder)
    assert served_name(".") == "SmolLM2-135M-Instruct.v2", "a relative path names the folder it resolves to"


def test_hf_cache_snapshot_is_served_under_its_hub_id(tmp_path):
    snapshot = tmp_path / "hub" / "models--HuggingFaceTB--SmolLM2-135M-Instruct" / "snapshots" / ("0a1b" * 10)
    assert served_name(snapshot) == "HuggingFaceTB/SmolLM2-135M-Instruct"


def test_served_model_name_setting(monkeypatch):
    assert RouterConfig().served_model_names == () and RouterConfig(served_model_name=" ").served_model_names == ()
    assert RouterConfig(served_model_name="a, b").served_model_names == ("a", "b")
    for bad in ("a,,b", "a,", ",", "a,a"):
        with pytest.raises(ValueError, match="served_model_name"):
            RouterConfig(served_model_name=bad)
    assert RouterConfig.from_args(["--served-model-name", "x,y"]).served_model_names == ("x", "y")
    monkeypatch.setenv("HANDOFF_SERVED_MODEL_NAME", "from-env")
    assert RouterConfig.from_args([]).served_model_names == ("from-env",)
    monkeypatch.setenv("HANDOFF_SERVED_MODEL_NAME", "")  # a ConfigMap's empty value: derive the name
    assert RouterConfig.from_args([]).served_model_names == ()


# --------------------------------------------------------------------------- a cluster serving a file path


@pytest.fixture(scope="module")
def cluster():
    # Colocated: one worker is enough to answer, and the fixture starts in half the time.
    c = Cluster(model=str(GGUF), num_prefill=0, num_decode=1, kv_memory_gib=0.05, threads=1,
                router=RouterConfig(prefill_mode="colocated")).start()
    yield c
    c.stop(drain_timeout_s=2)


def openai_client(http_port: int) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key="none", max_retries=0, timeout=120)


def test_derived_name_is_listed_accepted_and_reported(cluster):
    with openai_client(cluster.router.http_port) as client:
        assert [m.id for m in client.models.list().data] == [DERIVED]
        done = client.completions.create(model=DERIVED, prompt=PROMPT, max_tokens=2, temperature=0)
        assert done.model == DERIVED and done.choices[0].text
        for chunk in client.chat.completions.create(model=DERIVED, messages=QUESTION, max_tokens=2, stream=True):
            assert chunk.model == DERIVED


def test_the_model_path_is_not_a_model_name(cluster):
    with openai_client(cluster.router.http_port) as client:
        with pytest.raises(openai.NotFoundError) as err:
            client.completions.create(model=str(GGUF), prompt=PROMPT, max_tokens=2)
    body = err.value.body
    assert body["code"] == "model_not_found" and body["param"] == "model"
    assert repr(DERIVED) in body["message"], "the error names what is served"


def test_several_names_all_accepted_the_first_reported(cluster):
    cfg = replace(cluster.router_config, served_model_name="a,b", port=0, http_port=0)
    router = RouterServer(cfg, cluster.state).start()
    try:
        with openai_client(router.http_port) as client:
            assert [m.id for m in client.models.list().data] == ["a", "b"]
            for name in ("a", "b"):
                done = client.chat.completions.create(model=name, messages=QUESTION, max_tokens=2, temperature=0)
                assert done.model == "a" and done.choices[0].message.content is not None
            with pytest.raises(openai.NotFoundError) as err:
                client.completions.create(model=DERIVED, prompt=PROMPT, max_tokens=2)
            assert "'a', 'b'" in err.value.body["message"]
    finally:
        router.stop(grace_s=1)
