"""The SentencePiece path end to end: a BPE tokenizer.model trained here, a random-weight Llama HF folder
with that vocabulary, our Engine streaming text, and HF's greedy generate on the same folder."""
from __future__ import annotations

import io

import pytest
import sentencepiece
import torch

from common.engine.engine import Engine
from common.engine.output import FinishReason
from common.engine.runner import ModelRunner
from common.engine.sampling import SamplingParams
from common.engine.tokenizer import SentencePieceTokenizer, load_tokenizer
from tests.support.engine import Sinks, hf_greedy, run_until_done
from tests.support.checkpoints import save_hf_folder, tiny_hf_llama

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "a stitch in time saves nine and a penny saved is a penny earned",
    "to be or not to be that is the question",
    "all that glitters is not gold but the sun is bright today",
    "the rain in spain stays mainly in the plain",
    "she sells sea shells by the sea shore every morning",
] * 20

PROMPT = "the sea is bright, the fox jumps: héllo wörld 😀"
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def sp_folder(tmp_path_factory):
    """An HF checkpoint folder: config.json + model.safetensors + tokenizer.model, vocab sizes equal."""
    model_bytes = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS), model_writer=model_bytes, vocab_size=300, model_type="bpe",
        byte_fallback=True, character_coverage=1.0, minloglevel=2)
    sp = sentencepiece.SentencePieceProcessor(model_proto=model_bytes.getvalue())
    vocab_size = sp.get_piece_size()
    assert vocab_size == 300 and (sp.unk_id(), sp.bos_id(), sp.eos_id()) == (0, 1, 2)
    model = tiny_hf_llama(seed=11, vocab_size=vocab_size, bos_token_id=1, eos_token_id=2)
    # 256 of the 300 pieces are bytes: damp their LM-head rows so that the random model's output mixes
    # word pieces with byte pieces instead of looping over two bytes.
    byte_ids = [i for i in range(vocab_size) if sp.is_byte(i)]
    assert len(byte_ids) == 256
    with torch.no_grad():
        model.lm_head.weight[byte_ids] *= 0.6
    folder = save_hf_folder(model, tmp_path_factory.mktemp("sp_llama"))
    (folder / "tokenizer.model").write_bytes(model_bytes.getvalue())
    return folder


def test_sentencepiece_llama_end_to_end(sp_folder):
    tok = load_tokenizer(sp_folder)
    assert isinstance(tok, SentencePieceTokenizer)
    prompt_ids = tok.encode(PROMPT)
    assert prompt_ids[0] == tok.bos_id == 1  # Llama-family SentencePiece: BOS in front by default
    assert tok.decode(prompt_ids, skip_special=True) == PROMPT  # byte fallback round-trips é, ö and 😀
    assert any(tok.id_to_piece(i).startswith("<0x") for i in prompt_ids)

    runner = ModelRunner.load(sp_folder, dtype="fp32", num_blocks=32, block_size=4, progress=False,
                              packed_decode=False)
    assert runner.model.config.vocab_size == tok.vocab_size
    engine = Engine(runner, tok)
    sinks = Sinks()
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=MAX_TOKENS)
    engine.submit("sp", prompt_ids, params, sinks.sink("sp"))
    # A second, shorter request batched with it: the SentencePiece model also runs paged batched decode.
    engine.submit("sp2", prompt_ids[:5], params, sinks.sink("sp2"))
    run_until_done(engine, sinks)
    engine.check_integrity()
    assert engine.pool.num_free_blocks == engine.pool.num_blocks

    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(str(sp_folder), dtype=torch.float32).eval()
    for seq_id, ids in (("sp", prompt_ids), ("sp2", prompt_ids[:5])):
        got = sinks[seq_id]
        assert got.finish_reason == FinishReason.LENGTH
        assert len(got.token_ids) == MAX_TOKENS
        # Not a degenerate loop, and both kinds of piece: the test could otherwise miss a bug.
        assert len(set(got.token_ids)) >= 8, [tok.id_to_piece(i) for i in got.token_ids]
        kinds = {tok.id_to_piece(i).startswith("<0x") for i in got.token_ids}
        assert kinds == {True, False}, [tok.id_to_piece(i) for i in got.token_ids]
        # The streamed pieces add up to the decode of all tokens (control tokens are never streamed).
        assert got.text == tok.decode(got.token_ids, skip_special=True), got.token_ids
        assert got.token_ids == hf_greedy(hf, ids, MAX_TOKENS), seq_id
