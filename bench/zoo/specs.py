"""The small architectures: one recipe per family, each a small config with the feature that defines the
family switched on (and a test prompt longer than every window it has), its tokenizer's recipe, its real chat
template and its weight scales. Everything here goes into the cache key (small.arch_key): a change rebuilds.

Shared by all: hidden 256, 4 query heads on 2 KV heads, fp32, seeded random weights. Windows are 32 and Llama
3's original context 64, so the 96-token prompts of the tests cross both.
"""
from __future__ import annotations

SCHEMA = 1  # bump when the recipe changes in a way the dicts below do not show
QTYPES = ("F32", "Q8_0", "Q4_0", "Q4_K_M", "Q5_K_M", "Q6_K")  # llama-quantize's names; F32 is the converter's

LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
                   "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>",
                   "<|reserved_special_token_2|>", "<|start_header_id|>", "<|end_header_id|>",
                   "<|eom_id|>", "<|eot_id|>", "<|python_tag|>"]
PHI3_ADDED = ["<|endoftext|>", "<|assistant|>", "<|placeholder1|>", "<|placeholder2|>",
              "<|placeholder3|>", "<|placeholder4|>", "<|system|>", "<|end|>", "<|placeholder5|>",
              "<|placeholder6|>", "<|user|>"]  # Phi-3's ids 32000..32010, in order
MISTRAL_CONTROL = ["[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
                   "[TOOL_RESULTS]", "[/TOOL_RESULTS]"]  # Mistral v0.3's ids 3..9
GEMMA_USER_DEFINED = ["<mask>", "[@BOS@]", "<start_of_turn>", "<end_of_turn>"]


def _bpe(added_special=(), added_plain=(), fill_reserved_to=None, gen_eos=None, pipeline=None,
         post_processor="bytelevel", **config) -> dict:
    """A byte-level BPE tokenizer's recipe: SmolLM2's vocabulary and merges, the family's tokens appended
    (tokenizers.write_bpe_tokenizer); config is its tokenizer_config.json."""
    d = {"kind": "bpe-smollm", "added_special": list(added_special), "added_plain": list(added_plain),
         "fill_reserved_to": fill_reserved_to, "post_processor": post_processor, "config": config}
    if pipeline:
        d["pipeline"] = pipeline
    if gen_eos:
        d["gen_eos"] = list(gen_eos)
    return d


SPECS: dict[str, dict] = {
    # Llama 3.x: llama3 rope scaling (original_max_position_embeddings=64 so a >64-token test
    # crosses it: the converter turns it into rope_freqs.weight), GQA 4/2, head_dim 64, tied (3.2).
    "llama3": {
        "hf_class": "LlamaForCausalLM", "model_type": "llama", "seed": 1001,
        "config": {"hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 2,
                   "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
                   "hidden_act": "silu", "max_position_embeddings": 2048, "rms_norm_eps": 1e-5,
                   "rope_theta": 500000.0,
                   "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
                   "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": True,
                   "pretraining_tp": 1},
        "vocab_pad_to": 128,
        # No post-processor: with ByteLevel's the converter would write add_bos_token=False, with
        # Llama 3's TemplateProcessing HF would prepend BOS to the converter's hash text and the
        # hash would no longer be SmolLM's.  Without one the GGUF gets add_bos_token=True from
        # tokenizer_config.json (as real Llama 3 GGUFs); HF encode() adds no BOS (templates do).
        "tokenizer": _bpe(LLAMA3_SPECIALS, fill_reserved_to=49280, post_processor=None,
                          gen_eos=["<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"],
                          bos_token="<|begin_of_text|>", eos_token="<|eot_id|>",
                          add_bos_token=True, clean_up_tokenization_spaces=True,
                          model_max_length=131072),
        "chat_template": "meta-llama-Llama-3.1-8B-Instruct",
        "init": {"emb_std": 0.1, "final_norm_scale": 2.0},
    },
    # Mistral 7B v0.3 style: SentencePiece (llama tokenizer model) with [INST] controls,
    # sliding_window 32 (< test contexts), untied lm_head.
    "mistral": {
        "hf_class": "MistralForCausalLM", "model_type": "mistral", "seed": 1002,
        "config": {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
                   "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
                   "hidden_act": "silu", "max_position_embeddings": 2048, "rms_norm_eps": 1e-5,
                   "rope_theta": 1000000.0, "sliding_window": 32, "tie_word_embeddings": False},
        "tokenizer": {"kind": "spm", "trainer": {
            "vocab_size": 4096, "unk_id": 0, "bos_id": 1, "eos_id": 2, "pad_id": -1,
            "add_dummy_prefix": True, "control_symbols": MISTRAL_CONTROL},
            "config": {"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>",
                       "unk_token": "<unk>", "add_bos_token": True, "add_eos_token": False,
                       "legacy": False, "model_max_length": 1000000000000000019884624838656}},
        "chat_template": "mistralai-Mistral-Nemo-Instruct-2407",
        "init": {},
    },
    # Qwen2.5 style: QKV bias (non-zero), tied, vocab padded past the tokenizer ([PAD] rows).
    # Tokenizer: SmolLM2's vocabulary with Qwen2's pre-tokenizer (transformers 5 imposes it for
    # model_type qwen2), so the GGUF says tokenizer.ggml.pre = "qwen2" like real Qwen2 GGUFs; the
    # converter is told what that hash means ("pre_hash_name" below, bench.llama_tools.convert's
    # pre_hashes).
    "qwen2": {
        "hf_class": "Qwen2ForCausalLM", "model_type": "qwen2", "seed": 1003,
        "config": {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
                   "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_act": "silu",
                   "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
                   "use_sliding_window": False, "sliding_window": 2048, "max_window_layers": 2,
                   "tie_word_embeddings": True},
        "vocab_pad_to": 128,
        "tokenizer": _bpe(added_plain=["<tool_call>", "</tool_call>"], pipeline="qwen2",
                          tokenizer_class="Qwen2Tokenizer", bos_token=None, eos_token="<|im_end|>",
                          pad_token="<|endoftext|>",
                          unk_token=None, add_bos_token=False, errors="replace",
                          split_special_tokens=False, clean_up_tokenization_spaces=False,
                          model_max_length=131072),
        "chat_template": "Qwen-Qwen2.5-7B-Instruct", "pre_hash_name": "qwen2",
        "init": {"emb_std": 0.1, "final_norm_scale": 2.0},
    },
    # Qwen3 style: q_norm/k_norm, explicit head_dim 128 != hidden/heads (64), tied.
    "qwen3": {
        "hf_class": "Qwen3ForCausalLM", "model_type": "qwen3", "seed": 1004,
        "config": {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
                   "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 128,
                   "hidden_act": "silu", "max_position_embeddings": 2048, "rms_norm_eps": 1e-6,
                   "rope_theta": 1000000.0, "attention_bias": False, "use_sliding_window": False,
                   "sliding_window": None, "max_window_layers": 2, "tie_word_embeddings": True},
        "vocab_pad_to": 128,
        "tokenizer": _bpe(added_plain=["<tool_call>", "</tool_call>", "<tool_response>",
                                       "</tool_response>", "<think>", "</think>"],
                          bos_token=None, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                          unk_token=None, add_bos_token=False, errors="replace",
                          split_special_tokens=False, clean_up_tokenization_spaces=False,
                          model_max_length=131072),
        "chat_template": "Qwen-Qwen3-0.6B",
        "init": {"emb_std": 0.1, "final_norm_scale": 2.0},
    },
    # Phi-3 style: fused qkv_proj and gate_up_proj, SentencePiece + 11 added tokens after the
    # SP vocabulary, vocab padded to +64 (Phi-3: 32000 + 64), untied, GQA 4/2.
    "phi3": {
        "hf_class": "Phi3ForCausalLM", "model_type": "phi3", "seed": 1005,
        "config": {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
                   "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_act": "silu",
                   "max_position_embeddings": 4096, "original_max_position_embeddings": 4096,
                   "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "rope_scaling": None,
                   "sliding_window": None, "attention_bias": False, "tie_word_embeddings": False,
                   "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attention_dropout": 0.0},
        "vocab_extra": 64,
        "tokenizer": {"kind": "spm", "trainer": {
            "vocab_size": 4000, "unk_id": 0, "bos_id": 1, "eos_id": 2, "pad_id": -1,
            "add_dummy_prefix": True},
            "added_after": PHI3_ADDED,
            "gen_eos": ["<|endoftext|>", "<|assistant|>", "<|end|>"],
            "config": {"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>",
                       "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>",
                       "unk_token": "<unk>", "add_bos_token": False, "add_eos_token": False,
                       "legacy": False, "model_max_length": 131072}},
        "chat_template": "microsoft-Phi-3.5-mini-instruct",
        "init": {},
    },
    # Gemma 2 style: GeGLU, pre+post norms (stored as w, applied as 1+w), attn and final logit
    # softcapping (small caps so they bite), alternating sliding window 32, query_pre_attn_scalar 64
    # (= hidden/heads, the 27B rule) != head_dim 128, embeddings scaled by sqrt(hidden), tied.
    "gemma2": {
        "hf_class": "Gemma2ForCausalLM", "model_type": "gemma2", "seed": 1006,
        "config": {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4,
                   "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 128,
                   "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 8192,
                   "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "attention_bias": False,
                   "query_pre_attn_scalar": 64, "sliding_window": 32,
                   "attn_logit_softcapping": 10.0, "final_logit_softcapping": 15.0,
                   "cache_implementation": "hybrid", "tie_word_embeddings": True},
        "tokenizer": {"kind": "spm", "trainer": {
            "vocab_size": 4096, "pad_id": 0, "eos_id": 1, "bos_id": 2, "unk_id": 3,
            "pad_piece": "<pad>", "eos_piece": "<eos>", "bos_piece": "<bos>", "unk_piece": "<unk>",
            "user_defined_symbols": GEMMA_USER_DEFINED, "add_dummy_prefix": False},
            "gen_eos": ["<eos>", "<end_of_turn>"],
            "config": {"tokenizer_class": "GemmaTokenizer", "bos_token": "<bos>", "eos_token": "<eos>",
                       "pad_token": "<pad>", "unk_token": "<unk>", "add_bos_token": True,
                       "add_eos_token": False, "spaces_between_special_tokens": False}},
        "chat_template": "google-gemma-2-2b-it",
        "init": {"norm_offset": True, "qk_gain": 2.0, "emb_std": 0.03, "final_norm_scale": 6.0},
    },
    # Gemma 3 text style: q/k norm, 6 layers so llama.cpp's fixed 5-local:1-global pattern has a
    # global layer (layer 5), sliding window 32, rope_local_base_freq 10k vs rope_theta 1M, linear
    # rope scaling x8 on the global layers only (as the 4B+ models), tied.
    "gemma3": {
        "hf_class": "Gemma3ForCausalLM", "model_type": "gemma3_text", "seed": 1007,
        "config": {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 6,
                   "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 256,
                   "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 32768,
                   "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
                   "rope_scaling": {"rope_type": "linear", "factor": 8.0},
                   "sliding_window": 32, "sliding_window_pattern": 6, "query_pre_attn_scalar": 256,
                   "attention_bias": False, "attn_logit_softcapping": None,
                   "final_logit_softcapping": None, "cache_implementation": "hybrid",
                   "tie_word_embeddings": True},
        "tokenizer": {"kind": "spm", "trainer": {
            "vocab_size": 4096, "pad_id": 0, "eos_id": 1, "bos_id": 2, "unk_id": 3,
            "pad_piece": "<pad>", "eos_piece": "<eos>", "bos_piece": "<bos>", "unk_piece": "<unk>",
            "user_defined_symbols": GEMMA_USER_DEFINED, "add_dummy_prefix": False},
            "gen_eos": ["<eos>", "<end_of_turn>"],
            "config": {"tokenizer_class": "GemmaTokenizer", "bos_token": "<bos>", "eos_token": "<eos>",
                       "pad_token": "<pad>", "unk_token": "<unk>", "add_bos_token": True,
                       "add_eos_token": False, "spaces_between_special_tokens": False}},
        "chat_template": "gemma3",
        "init": {"norm_offset": True, "emb_std": 0.03, "final_norm_scale": 6.0},
    },
}


# Weight scales: linear W ~ N(0, gain/sqrt(fan_in)) keeps activations O(1);
# embeddings and lm_head N(0, 0.2) so logits have std ~3 (far from uniform); norms drawn so the
# applied scale is U(0.6, 1.4) (Gemma stores scale-1); biases N(0, 0.2).  Tied models use smaller
# embeddings and a larger final norm (x2, Gemma x6 since it also multiplies embeddings by
# sqrt(hidden)): otherwise the residual stays close to the input token's embedding and the tied
# head predicts the input token again with probability ~1.
INIT_DEFAULTS = {"emb_std": 0.2, "head_std": 0.2, "bias_std": 0.2, "norm_lo": 0.6, "norm_hi": 1.4,
                 "norm_offset": False, "qk_gain": 1.0, "final_norm_scale": 1.0}

ARCHS = tuple(SPECS)
