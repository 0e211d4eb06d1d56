"""The demo models of `graphsafe train`: plain torch modules with torch.nn.Embedding.

They use nothing from graphsafe on purpose: compile_step traces them and its rewrite pass swaps aten's
embedding backward for graphsafe's. Everything in them is capturable: attention uses an explicit causal mask
buffer (no data-dependent shapes), and the mixture of experts computes every expert densely and masks the
outputs, so routing never changes a shape (an expert without tokens gets a gradient of exact zeros, which a
skip_zeros optimizer leaves untouched, states included).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, seq_len: int) -> None:
        super().__init__()
        if dim % heads:
            raise ValueError(f"dim {dim} must be divisible by heads {heads}")
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)
        # A buffer, so the traced graph takes it as an input instead of building it on the host at every step.
        self.register_buffer("causal", torch.ones(seq_len, seq_len, dtype=torch.bool).tril(), persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).reshape(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        # Explicit attention rather than scaled_dot_product_attention: its CUDA backward kernels may use atomics,
        # and the trainer's determinism check compares runs bitwise.
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.heads)
        scores = scores.masked_fill(~self.causal[:t, :t], float("-inf"))
        y = scores.softmax(-1) @ v
        return self.out(y.transpose(1, 2).reshape(b, t, d))


class MixtureOfExperts(nn.Module):
    """Top-1 routed experts, computed densely (every expert on every token) and masked.

    The router's bias starts at -8 for the upper half of the experts ("cold" experts), so top-1 routing sends
    them no tokens at first: their gradients are exact zeros, which is what skip_zeros is for.
    """

    def __init__(self, dim: int, hidden: int, experts: int) -> None:
        super().__init__()
        self.experts = experts
        self.router = nn.Linear(dim, experts)
        with torch.no_grad():
            self.router.bias.zero_()
            self.router.bias[experts // 2:] = -8.0
        self.w_in = nn.Parameter(torch.randn(experts, dim, hidden) / math.sqrt(dim))
        self.b_in = nn.Parameter(torch.zeros(experts, 1, hidden))
        self.w_out = nn.Parameter(torch.randn(experts, hidden, dim) / math.sqrt(hidden))

    def routing(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """(probability of the chosen expert [n], one-hot choice [n, experts])."""
        probs = self.router(x).softmax(-1)
        top_prob, top = probs.max(-1)
        # one_hot(top, E) would check the index range on the host; a comparison with arange does not.
        choice = (top.unsqueeze(-1) == torch.arange(self.experts, device=x.device)).to(x.dtype)
        return top_prob, choice

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        top_prob, choice = self.routing(x)
        hidden = F.gelu(torch.einsum("nd,edh->enh", x, self.w_in) + self.b_in)
        hidden = hidden * choice.t().unsqueeze(-1)  # tokens not routed to an expert contribute exact zeros
        y = torch.einsum("enh,ehd->nd", hidden, self.w_out) * top_prob.unsqueeze(-1)
        return y.reshape(shape)

    @torch.no_grad()
    def tokens_per_expert(self, x: Tensor) -> Tensor:
        return self.routing(x.reshape(-1, x.shape[-1]))[1].sum(0)


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, seq_len: int, moe_experts: int = 0) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = Attention(dim, heads, seq_len)
        self.mlp = (MixtureOfExperts(dim, 2 * dim, moe_experts) if moe_experts
                    else nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim)))

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TransformerLM(nn.Module):
    """A small GPT-style LM with a large vocabulary (untied input and output tables). Token 0 is padding."""

    def __init__(self, vocab: int, dim: int, layers: int, heads: int, seq_len: int, moe_experts: int = 0) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, dim, padding_idx=0)
        self.positions = nn.Embedding(seq_len, dim)
        self.blocks = nn.ModuleList(
            Block(dim, heads, seq_len, moe_experts if i == layers - 1 else 0) for i in range(layers)
        )
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.register_buffer("position_ids", torch.arange(seq_len), persistent=False)
        # Token rows keep nn.Embedding's N(0, 1) init (row 0, the padding row, zero). With GPT-2's 0.02 the
        # residual stream would start dominated by attention's near-uniform average, which every token shares:
        # top-1 routing then sends almost every token to one expert instead of spreading them over the warm half.
        with torch.no_grad():
            self.positions.weight.normal_(0.0, 0.02)

    def embed(self, ids: Tensor) -> Tensor:
        return self.tokens(ids) + self.positions(self.position_ids[: ids.shape[1]])

    def forward(self, ids: Tensor) -> Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))

    @torch.no_grad()
    def experts_without_tokens(self, ids: Tensor) -> list[int] | None:
        """The experts of the MoE layer to which top-1 routing gives no token of this batch (None without MoE)."""
        x = self.embed(ids)
        for block in self.blocks:
            if isinstance(block.mlp, MixtureOfExperts):
                h = x + block.attn(block.norm1(x))
                return (block.mlp.tokens_per_expert(block.norm2(h)) == 0).nonzero().flatten().tolist()
            x = block(x)
        return None


def lm_loss(logits: Tensor, targets: Tensor) -> Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


class RecsysModel(nn.Module):
    """A recommender with large tables: user id, item id, item category, and the user's history as a bag
    of items (mean of the rows, padding item 0 left out). The history table uses padding_idx=0 and
    scale_grad_by_freq=True, the category table padding_idx=0."""

    def __init__(self, num_users: int, num_items: int, num_categories: int, dim: int) -> None:
        super().__init__()
        self.users = nn.Embedding(num_users, dim)
        self.items = nn.Embedding(num_items, dim)
        self.categories = nn.Embedding(num_categories, dim, padding_idx=0)
        self.history = nn.Embedding(num_items, dim, padding_idx=0, scale_grad_by_freq=True)
        self.mlp = nn.Sequential(nn.Linear(4 * dim + 1, 4 * dim), nn.ReLU(), nn.Linear(4 * dim, 1))
        for table in (self.users, self.items, self.categories, self.history):
            nn.init.normal_(table.weight, 0.0, 0.05)
            if table.padding_idx is not None:
                with torch.no_grad():
                    table.weight[table.padding_idx].zero_()

    def forward(self, user: Tensor, item: Tensor, category: Tensor, history: Tensor) -> Tensor:
        u, i = self.users(user), self.items(item)
        present = (history != 0).to(u.dtype)
        bag = self.history(history).sum(1) / present.sum(1, keepdim=True).clamp_min(1.0)
        features = torch.cat([u, i, self.categories(category), bag, (u * i).sum(-1, keepdim=True)], -1)
        return self.mlp(features).squeeze(-1)


def recsys_loss(logits: Tensor, click: Tensor) -> Tensor:
    return F.binary_cross_entropy_with_logits(logits, click)
