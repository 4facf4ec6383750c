"""The Llama baseline: Llama written the usual way, as an nn.Module (torchtitan's and
Hugging Face's structure: RMSNorm, grouped-query attention with rotary positions, SwiGLU,
untied head). Same architecture as fxmega.models.llama, so speeds compare like for like."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def rotary(seq: int, head_dim: int, theta: float, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim)
    angles = torch.outer(torch.arange(seq, device=device).float(), freqs)
    return angles.cos(), angles.sin()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (first half, second half) of each head's dims: ``[batch, heads, seq, dim]``."""
    a, b = x.float().chunk(2, dim=-1)
    return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1).type_as(x)


class Block(nn.Module):
    def __init__(self, d: int, heads: int, kv_heads: int, d_ff: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, d // heads
        self.attn_norm, self.mlp_norm = nn.RMSNorm(d, eps=1e-5), nn.RMSNorm(d, eps=1e-5)
        self.wq = nn.Linear(d, heads * self.head_dim, bias=False)
        self.wk = nn.Linear(d, kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(d, kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(heads * self.head_dim, d, bias=False)
        self.w_gate = nn.Linear(d, d_ff, bias=False)
        self.w_up = nn.Linear(d, d_ff, bias=False)
        self.w_down = nn.Linear(d_ff, d, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        h = self.attn_norm(x)
        q = self.wq(h).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = self.wk(h).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(h).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.kv_heads != self.heads)
        x = x + self.wo(y.transpose(1, 2).reshape(b, s, -1))
        h = self.mlp_norm(x)
        return x + self.w_down(F.silu(self.w_gate(h)) * self.w_up(h))


class PlainLlama(nn.Module):
    def __init__(self, vocab: int, d: int, layers: int, heads: int, kv_heads: int, d_ff: int,
                 theta: float = 500000.0) -> None:
        super().__init__()
        self.head_dim, self.theta = d // heads, theta
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d, heads, kv_heads, d_ff) for _ in range(layers))
        self.final_norm = nn.RMSNorm(d, eps=1e-5)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        cos, sin = rotary(tokens.shape[1], self.head_dim, self.theta, tokens.device)
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, cos, sin)
        logits = self.head(self.final_norm(x))
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
