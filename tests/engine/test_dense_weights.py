"""Which weights each pool holds (model.py, --dense-weights): a decode worker that keeps no dense copies (lazy)
makes them from the file when it must prefill, and they give the same bits as copies kept from load."""
from __future__ import annotations

import pytest
import torch

from common.engine.kv_cache import KVCache
from common.engine.model import LAYER_MATRICES, Llama
from common.engine.runner import DecodeItem, ModelRunner, PrefillItem
from common.worker import WorkerConfig
from tests.support.native import skip_where_bf16_is_emulated


def _run(model: Llama, ids: list[int], dtype: torch.dtype):
    """A prompt's logits, 4 greedy decode tokens after it, and the K/V the prompt left in the pool."""
    runner = ModelRunner(model, KVCache(model.config, 64, 16, dtype), True)
    runner.cache.pool.allocate("s", len(ids) + 8)
    logits = runner.prefill([PrefillItem("s", ids)])
    kv = runner.cache.export_seq("s", len(ids))
    tokens = [int(logits.argmax())]
    for i in range(4):
        tokens.append(int(runner.decode([DecodeItem("s", tokens[-1], len(ids) + i)]).argmax()))
    return logits, tokens, kv


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_lazy_dense_copies_prefill_the_same_bits_as_kept_ones(smollm2_weights, chat_ids, dtype):
    if dtype == torch.bfloat16:
        skip_where_bf16_is_emulated("lazy dense copies in bf16")
    w = smollm2_weights
    kept = Llama(w.config, w.tensors, dtype=dtype, packed=w.packed, keep_dense=True)
    lazy = Llama(w.config, w.tensors, dtype=dtype, packed=w.packed, keep_dense=False)
    assert lazy.has_packed and all(layer[n] is None for layer in lazy.layers for n in LAYER_MATRICES)
    assert all(layer[n] is not None for layer in kept.layers for n in LAYER_MATRICES)
    assert lazy.weight_bytes() < 0.6 * kept.weight_bytes()  # the packed file's bytes, not those and the dense
    ids = chat_ids()
    (a_logits, a_tokens, a_kv), (b_logits, b_tokens, b_kv) = _run(kept, ids, dtype), _run(lazy, ids, dtype)
    assert torch.equal(a_logits, b_logits) and torch.equal(a_kv, b_kv) and a_tokens == b_tokens


def test_the_dense_weights_setting_is_checked_where_it_is_read():
    with pytest.raises(ValueError, match="dense_weights must be auto, keep or lazy, got 'always'"):
        WorkerConfig(role="decode", dense_weights="always")
