"""Synthetic training data from a seed (nothing is downloaded), with structure a model can learn quickly.

Language model: a fixed random Markov chain over the vocabulary. Each token has a few successors, drawn from a
Zipf-skewed popularity over the vocabulary, with fixed probabilities. The skew matters: with 32K+ tokens and a
few hundred tokens per batch, a uniform chain would show each bigram about once in a short run, while here the
popular tokens (and their bigrams) recur in every batch, so the loss falls within tens of steps; the floor is
the chain's entropy (about ln(successors)).

Recommender: (user, item, category, history) rows with Zipf-skewed ids and a click label given by hidden
ground-truth factors (item popularity plus a user-item affinity), so the tables have something to learn.

Data parallelism: with `world` ranks, every rank draws the global batch of world * batch rows from the seed and
keeps rows rank * batch .. (rank + 1) * batch - 1. So each rank sees different rows, every run the same ones, and
the ranks together see exactly the batches of a single process with batch world * batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

ZIPF_EXPONENT = 1.1


def _zipf_probs(n: int, gen: torch.Generator, exponent: float = ZIPF_EXPONENT) -> Tensor:
    """Zipf probabilities over n ids, scattered over the id space by a seeded permutation. Id 0 (padding in
    the models) gets none."""
    ranks = torch.arange(1, n, dtype=torch.float64)
    probs = torch.zeros(n, dtype=torch.float64)
    probs[1 + torch.randperm(n - 1, generator=gen)] = ranks.pow(-exponent)
    return probs / probs.sum()


@dataclass
class MarkovChain:
    successors: Tensor  # [vocab, k] int64: the possible next tokens
    cumulative: Tensor  # [k] float64: cumulative probabilities of picking successor j (same for every token)
    start: Tensor  # [vocab] float64: where sequences start

    @staticmethod
    def build(vocab: int, seed: int, num_successors: int = 4) -> "MarkovChain":
        if vocab < 8:
            raise ValueError(f"vocab must be >= 8, got {vocab}")
        gen = torch.Generator().manual_seed(seed)
        popularity = _zipf_probs(vocab, gen)
        successors = torch.multinomial(popularity.float(), vocab * num_successors, replacement=True, generator=gen)
        weights = torch.arange(num_successors, 0, -1, dtype=torch.float64)  # successor 0 most likely
        return MarkovChain(successors.reshape(vocab, num_successors), torch.cumsum(weights / weights.sum(), 0),
                           popularity)

    def entropy(self) -> float:
        """Entropy of one transition in nats: the loss a perfect model reaches."""
        p = torch.diff(self.cumulative, prepend=torch.zeros(1, dtype=torch.float64))
        return float(-(p * p.log()).sum())

    def sample(self, batch: int, length: int, gen: torch.Generator) -> Tensor:
        """[batch, length] int64 token sequences."""
        tokens = torch.empty(batch, length, dtype=torch.int64)
        tokens[:, 0] = torch.multinomial(self.start.float(), batch, replacement=True, generator=gen)
        for t in range(1, length):
            pick = torch.searchsorted(self.cumulative, torch.rand(batch, generator=gen, dtype=torch.float64))
            pick = pick.clamp_max(self.successors.shape[1] - 1)
            tokens[:, t] = self.successors[tokens[:, t - 1], pick]
        return tokens


class LMData:
    """Batches (inputs, targets) of next-token prediction on the Markov chain, from a seed."""

    def __init__(self, vocab: int, batch: int, seq_len: int, seed: int, device: torch.device, rank: int = 0,
                 world: int = 1) -> None:
        self.chain = MarkovChain.build(vocab, seed)
        self.batch, self.seq_len, self.device = batch, seq_len, device
        self.rows = slice(rank * batch, (rank + 1) * batch)
        self.world = world
        self.gen = torch.Generator().manual_seed(seed + 1)

    def __next__(self) -> tuple[Tensor, Tensor]:
        tokens = self.chain.sample(self.batch * self.world, self.seq_len + 1, self.gen)[self.rows]
        return tokens[:, :-1].to(self.device), tokens[:, 1:].to(self.device)

    def describe(self) -> str:
        return (f"Markov chain over {self.chain.successors.shape[0]} tokens, {self.chain.successors.shape[1]} successors "
                f"each (loss floor {self.chain.entropy():.2f} nats)")


class RecsysData:
    """Batches ((user, item, category, history), click) with a hidden ground truth, from a seed."""

    HISTORY = 8
    FACTORS = 8

    def __init__(self, num_users: int, num_items: int, num_categories: int, batch: int, seed: int,
                 device: torch.device, rank: int = 0, world: int = 1) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.user_probs, self.item_probs = _zipf_probs(num_users, gen).float(), _zipf_probs(num_items, gen).float()
        self.item_category = torch.randint(1, num_categories, (num_items,), generator=gen)
        self.user_factors = torch.randn(num_users, self.FACTORS, generator=gen)
        self.item_factors = torch.randn(num_items, self.FACTORS, generator=gen)
        self.item_bias = 2.0 * torch.randn(num_items, generator=gen)
        self.batch, self.device = batch, device
        self.rows = slice(rank * batch, (rank + 1) * batch)
        self.world = world
        self.gen = torch.Generator().manual_seed(seed + 1)

    def __next__(self):
        b, g, rows = self.batch * self.world, self.gen, self.rows
        user = torch.multinomial(self.user_probs, b, replacement=True, generator=g)[rows]
        item = torch.multinomial(self.item_probs, b, replacement=True, generator=g)[rows]
        history = torch.multinomial(self.item_probs, b * self.HISTORY, replacement=True, generator=g).reshape(b, -1)
        # Variable-length histories, padded with item 0 (the tables' padding_idx).
        lengths = torch.randint(1, self.HISTORY + 1, (b, 1), generator=g)
        history = torch.where(torch.arange(self.HISTORY) < lengths, history, 0)[rows]
        logit = self.item_bias[item] + (self.user_factors[user] * self.item_factors[item]).sum(-1) / self.FACTORS ** 0.5
        click = (logit > 0).float()
        category = self.item_category[item]
        to = self.device
        return user.to(to), item.to(to), category.to(to), history.to(to), click.to(to)

    def describe(self) -> str:
        return (f"clicks from hidden factors, {self.user_probs.numel()} users, {self.item_probs.numel()} items "
                f"(Zipf ids, histories of up to {self.HISTORY} items padded with 0)")
