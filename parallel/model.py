"""A small Llama-style decoder: RMSNorm pre-norms, RoPE attention through SDPA, SwiGLU MLP.

Plain torch, as torchtitan writes its models: the norms are torch.nn.RMSNorm, and `build_model` converts
them to shardnorm's (`shardnorm.convert`, same Parameters) when asked; parallelism is applied afterwards by
parallel/parallelize.py. Attention and MLP infer their local head / hidden counts from tensor shapes, so
tensor parallelism needs no model changes.
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

import shardnorm
from parallel.config import VOCAB_SIZE, ModelConfig


def rope_tables(head_dim: int, max_seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotary angles, each (max_seq_len, head_dim // 2)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate (batch, seq, heads, head_dim) by position, half-split layout."""
    x1, x2 = x.float().chunk(2, dim=-1)
    cos, sin = cos[: x.shape[1], None, :], sin[: x.shape[1], None, :]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).type_as(x)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.head_dim = cfg.dim // cfg.n_heads
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * self.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, seq = x.shape[:2]
        # -1 heads: all of them, or this rank's share under tensor parallelism
        q = apply_rope(self.wq(x).view(batch, seq, -1, self.head_dim), cos, sin)
        k = apply_rope(self.wk(x).view(batch, seq, -1, self.head_dim), cos, sin)
        v = self.wv(x).view(batch, seq, -1, self.head_dim)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                             enable_gqa=q.shape[1] != k.shape[1])
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attention_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x, cos, sin):
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(VOCAB_SIZE, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, VOCAB_SIZE, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        cos, sin = rope_tables(cfg.dim // cfg.n_heads, cfg.max_seq_len, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """Normal(0.02) weights; the projections back into the residual stream scaled by depth."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
        for block in self.layers:
            for proj in (block.attention.wo, block.feed_forward.w2):
                nn.init.normal_(proj.weight, std=0.02 / math.sqrt(2 * self.cfg.n_layers))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits (batch, seq, VOCAB_SIZE) for byte tokens (batch, seq)."""
        x = self.tok_embeddings(tokens)
        for block in self.layers:
            x = block(x, self.rope_cos, self.rope_sin)
        return self.output(self.norm(x))


def build_model(cfg: ModelConfig, norm: str, device: torch.device, seed: int) -> Transformer:
    """The same initial weights for a given seed on every rank (sharding happens afterwards); with
    norm="shardnorm" the norms are converted in place (model.norm_keep_output: keep their outputs or not)."""
    if norm not in ("shardnorm", "torch"):
        raise ValueError(f"norm must be 'shardnorm' or 'torch', got {norm!r}")
    torch.manual_seed(seed)
    with torch.device(device):
        model = Transformer(cfg)
    if norm == "shardnorm":
        shardnorm.convert(model, keep_output=cfg.norm_keep_output)
    return model
