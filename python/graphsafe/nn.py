"""Drop-in modules whose backward runs on graphsafe's deterministic, capture-safe kernels."""

from __future__ import annotations

import torch
from torch import Tensor

from . import ops

__all__ = ["Embedding"]


class Embedding(torch.nn.Embedding):
    """torch.nn.Embedding whose weight gradient comes from graphsafe.ops.embedding_backward.

    Same constructor, attributes and state_dict as torch.nn.Embedding (it is a subclass, so
    from_pretrained and isinstance checks work too). The gradient is dense, deterministic, accumulated in
    fp32 and free of host synchronisations, so a training step that uses it can be captured in a CUDA graph.
    padding_idx and scale_grad_by_freq are honoured. max_norm and sparse=True are not supported.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        padding_idx: int | None = None,
        max_norm: float | None = None,
        norm_type: float = 2.0,
        scale_grad_by_freq: bool = False,
        sparse: bool = False,
        _weight: Tensor | None = None,
        _freeze: bool = False,
        device=None,
        dtype=None,
    ) -> None:
        if max_norm is not None:
            raise NotImplementedError(
                "graphsafe.nn.Embedding does not support max_norm: it rewrites weight rows in place during the "
                "forward pass, which a captured, deterministic step cannot allow. Renormalise the table outside "
                "the step (e.g. with torch.embedding_renorm_ under torch.no_grad()), or use torch.nn.Embedding."
            )
        if sparse:
            raise NotImplementedError(
                "graphsafe.nn.Embedding does not support sparse=True: its gradient is dense (torch sparse "
                "gradients need a host sync to size). Keep sparse=False; to leave rows without tokens untouched, "
                "use a graphsafe optimizer with skip_zeros=True, or use torch.nn.Embedding(sparse=True)."
            )
        super().__init__(
            num_embeddings,
            embedding_dim,
            padding_idx=padding_idx,
            max_norm=None,
            norm_type=norm_type,
            scale_grad_by_freq=scale_grad_by_freq,
            sparse=False,
            _weight=_weight,
            _freeze=_freeze,
            device=device,
            dtype=dtype,
        )

    def forward(self, input: Tensor) -> Tensor:
        padding_idx = -1 if self.padding_idx is None else self.padding_idx
        return ops.embedding(self.weight, input, padding_idx, self.scale_grad_by_freq)
