"""Tiny Hugging Face models for the shardnorm parity tests: configs, norm weights away from their init.

No downloads: every model is built from a config (hidden 64, 2 layers, vocab 100, 4 heads / 2 kv
heads where the architecture has them), fp32, eager attention (deterministic on CPU).
"""

import torch

VOCAB, HIDDEN, LAYERS, HEADS, KV_HEADS, MLP = 100, 64, 2, 4, 2, 96

_DECODER = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                num_key_value_heads=KV_HEADS, intermediate_size=MLP, max_position_embeddings=64)

# model_type -> config overrides; the keys the architecture's norms exercise are noted
ARCHITECTURES = {
    "llama": _DECODER,
    "mistral": _DECODER,
    "qwen2": _DECODER,
    "qwen3": dict(_DECODER, head_dim=16),  # per-head q/k norms
    "qwen3_next": dict(_DECODER, head_dim=16, layer_types=["linear_attention", "full_attention"],
                       num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                       shared_expert_intermediate_size=32, linear_num_key_heads=2, linear_num_value_heads=4,
                       linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4),
    "gemma": dict(_DECODER, head_dim=16),  # 1 + weight
    "gemma2": dict(_DECODER, head_dim=16),
    "gemma3_text": dict(_DECODER, head_dim=16, sliding_window=8),  # q/k norms, 1 + weight
    "olmo2": _DECODER,  # q/k norms over the whole projection, scale in fp32
    "cohere": _DECODER,  # LayerNorm without bias
    "gpt2": dict(vocab_size=VOCAB, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS, n_positions=64),
    "gpt_neox": dict(_DECODER, num_key_value_heads=None),
    "phi3": _DECODER,
    "phi": _DECODER,
    "t5": dict(vocab_size=VOCAB, d_model=HIDDEN, d_kv=16, d_ff=MLP, num_layers=LAYERS, num_heads=HEADS),
    "falcon": dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS),
    "bloom": dict(vocab_size=VOCAB, hidden_size=HIDDEN, n_layer=LAYERS, n_head=HEADS),
    "mixtral": dict(_DECODER, num_local_experts=4, num_experts_per_tok=2),
    "stablelm": dict(_DECODER, qk_layernorm=True),  # per-head nn.LayerNorms
    "olmo": _DECODER,  # weightless LayerNorm: left alone
}


def tiny_config(model_type: str):
    from transformers import AutoConfig

    overrides = {k: v for k, v in ARCHITECTURES[model_type].items() if v is not None}
    config = AutoConfig.for_model(model_type, **overrides)
    if model_type == "gpt_neox":
        config.num_key_value_heads = HEADS
    for key in ("attention_dropout", "hidden_dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop", "dropout_rate",
                "hidden_dropout_prob", "attention_probs_dropout_prob"):
        if hasattr(config, key):
            setattr(config, key, 0.0)
    for key in ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id"):
        if getattr(config, key, None) is not None:
            setattr(config, key, 0)
    config._attn_implementation = "eager"
    return config


def tiny_model(model_type: str, seed: int):
    """The model, fp32, eval mode (no dropout), norm weights/biases moved off their init by N(0, 0.5)."""
    import transformers

    config = tiny_config(model_type)
    auto = transformers.AutoModelForSeq2SeqLM if config.is_encoder_decoder else transformers.AutoModelForCausalLM
    torch.manual_seed(seed)
    model = auto.from_config(config).float().eval()
    randomize_norms(model, seed)
    return model


def randomize_norms(model: torch.nn.Module, seed: int) -> None:
    from shardnorm.norm_families import lookup

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if lookup(m) is not None or "norm" in type(m).__name__.lower():
                for p in m.parameters(recurse=False):  # drawn on the CPU: the same values whatever p's device
                    p.add_(0.5 * torch.randn(p.shape, generator=g, dtype=p.dtype).to(p.device))


def batch(model, seed: int, rows: int = 2, seq: int = 8) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (rows, seq), generator=g)
    out = {"input_ids": ids, "labels": torch.randint(0, VOCAB, (rows, seq), generator=g)}
    if model.config.is_encoder_decoder:
        out["decoder_input_ids"] = torch.randint(0, VOCAB, (rows, seq), generator=g)
    return out
