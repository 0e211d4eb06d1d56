"""Index streams for embedding benchmarks, drawn on the CPU from a seeded generator (same on every device)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

ZIPF_EXPONENT = 1.05


def uniform_indices(num_weights: int, count: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, num_weights, (count,), generator=generator, dtype=torch.int64)


def zipf_indices(num_weights: int, count: int, seed: int, exponent: float = ZIPF_EXPONENT) -> torch.Tensor:
    """Row of rank k drawn with probability proportional to 1/k**exponent; ranks land on a random permutation.

    For 4M rows this is a 32 MB probability vector and a multinomial over it: well under a second on a CPU.
    """
    generator = torch.Generator().manual_seed(seed)
    probability = torch.arange(1, num_weights + 1, dtype=torch.float64).pow_(-exponent)
    ranks = torch.multinomial(probability, count, replacement=True, generator=generator)
    rows_by_rank = torch.randperm(num_weights, generator=generator)
    return rows_by_rank[ranks]


def hot_row_indices(num_weights: int, count: int, hot_rows: int, seed: int) -> torch.Tensor:
    """Uniform over `hot_rows` distinct rows chosen at random: many tokens share few rows (worst case for atomics)."""
    generator = torch.Generator().manual_seed(seed)
    rows = torch.randperm(num_weights, generator=generator)[:hot_rows]
    picks = torch.randint(0, hot_rows, (count,), generator=generator)
    return rows[picks]


def most_frequent_row(indices: torch.Tensor, num_weights: int) -> int:
    return int(torch.bincount(indices.cpu(), minlength=num_weights).argmax())


@dataclass(frozen=True)
class TableCase:
    """An embedding table and one batch of indices into it: the `cpu` and `sparse` suites' cases."""

    name: str
    num_weights: int
    dim: int
    dtype: torch.dtype
    tokens: int
    zipf: bool  # zipf_indices, else uniform_indices

    def indices(self, seed: int) -> torch.Tensor:
        make = zipf_indices if self.zipf else uniform_indices
        return make(self.num_weights, self.tokens, seed)

    def grad(self, generator: torch.Generator) -> torch.Tensor:
        """[tokens, dim] ~ N(0, 1) in the case's dtype, on the CPU."""
        return torch.randn((self.tokens, self.dim), generator=generator).to(self.dtype)

    def fields(self) -> dict:
        """The table's shape as the suites' records state it."""
        return dict(num_weights=self.num_weights, dim=self.dim, dtype=str(self.dtype).removeprefix("torch."),
                    tokens=self.tokens)
