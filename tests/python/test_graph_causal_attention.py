"""compile_step's drop_constant_causal_masks pass: an attention whose mask is a constant causal pattern runs with
is_causal=True instead (graph/causal_attention.py), and nothing else does. References: the same attention with
is_causal=True in a plain eager loop, and the unmodified model's eager loop (an unmodified Hugging Face Llama too).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import graphsafe
import graphsafe.optim
from conftest import assert_bitwise_equal, requires_cuda

SEQ, DIM, HEADS, CLASSES = 12, 16, 2, 5


class MaskedAttention(torch.nn.Module):
    """One attention layer over a (batch, SEQ, DIM) input, its mask made by `mask(ids)`."""

    def __init__(self, mask) -> None:
        super().__init__()
        self.qkv = torch.nn.Linear(DIM, 3 * DIM)
        self.head = torch.nn.Linear(DIM, CLASSES)
        self.mask = mask

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, HEADS, DIM // HEADS).permute(2, 0, 3, 1, 4)
        mask = self.mask(x) if self.mask is not None else None
        if mask is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.head(out.transpose(1, 2).reshape(b, s, DIM))


def bool_causal(x):  # built from positions, as Hugging Face's masking utilities do
    pos = torch.arange(x.shape[1], device=x.device)
    return (pos[None, :] <= pos[:, None]).expand(x.shape[0], 1, -1, -1)


def float_causal(x, fill=float("-inf")):
    pos = torch.arange(x.shape[1], device=x.device)
    return torch.where(pos[None, :] <= pos[:, None], 0.0, fill).expand(x.shape[0], 1, -1, -1)


def sliding_window(x):  # causal, but keys further back than 3 positions masked as well
    pos = torch.arange(x.shape[1], device=x.device)
    return ((pos[None, :] <= pos[:, None]) & (pos[:, None] - pos[None, :] < 3)).expand(x.shape[0], 1, -1, -1)


def from_input(x):  # depends on the batch: cannot be evaluated when compiling
    return (x[..., :1] > -10).transpose(1, 2).unsqueeze(1) & bool_causal(x)


def loss_fn(out, target):
    return F.cross_entropy(out.flatten(0, 1), target.flatten())


def batches(n, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(3, SEQ, DIM, generator=gen), torch.randint(0, CLASSES, (3, SEQ), generator=gen))
            for _ in range(n)]


def run_steps(model, loss, batches, compiled: bool, mode="eager", lr=1e-2):
    """(compile_step's step or None, the losses, the parameters) after one step per batch, compiled or in a plain
    eager loop, with graphsafe AdamW."""
    optimizer = graphsafe.optim.AdamW(model.parameters(), lr=lr)
    step = graphsafe.compile_step(model, loss, optimizer, mode=mode) if compiled else None
    losses = []
    for inputs, targets in batches:
        if compiled:
            losses.append(step((inputs, targets)))
        else:
            value = loss(model(inputs), targets)
            value.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(value.detach())
    return step, torch.stack(losses), list(model.parameters())


def train(mask, compiled: bool, steps: int = 3, device="cpu", mode="eager"):
    torch.manual_seed(0)
    model = MaskedAttention(mask).to(device)
    return run_steps(model, loss_fn, [(x.to(device), t.to(device)) for x, t in batches(steps)], compiled, mode)


@pytest.mark.parametrize("mask", [bool_causal, float_causal, lambda x: float_causal(x, torch.finfo(torch.float32).min)],
                         ids=["bool", "float-inf", "float-lowest"])
def test_a_constant_causal_mask_becomes_is_causal(mask):
    step, losses, params = train(mask, compiled=True)
    report = step.report.causal_attention
    assert len(report.rewritten) == 1 and not report.left_alone, str(report)
    graph_ops = [str(n.target) for n in step.graph_module.graph.nodes if n.op == "call_function"]
    assert not any("where" in op or "le." in op for op in graph_ops if "attention" not in op), graph_ops
    # The reference: the same model written with is_causal=True, in a plain eager loop.
    _, ref_losses, ref_params = train(None, compiled=False)
    assert_bitwise_equal(losses, ref_losses, "losses")
    for p, r in zip(params, ref_params):
        assert_bitwise_equal(p.detach(), r.detach(), "parameters")


@pytest.mark.parametrize("mask, reason", [(sliding_window, "not the causal pattern"),
                                          (from_input, "depends on the step's inputs")],
                         ids=["sliding-window", "from-input"])
def test_other_masks_stay(mask, reason):
    step, losses, params = train(mask, compiled=True)
    report = step.report.causal_attention
    assert not report.rewritten and report.left_alone and reason in report.left_alone[0][1], str(report)
    _, ref_losses, ref_params = train(mask, compiled=False)
    torch.testing.assert_close(losses, ref_losses)
    for p, r in zip(params, ref_params):
        torch.testing.assert_close(p.detach(), r.detach())


@requires_cuda
@pytest.mark.parametrize("mask", [bool_causal, float_causal], ids=["bool", "float"])
def test_on_cuda_the_efficient_kernel_runs_is_causal_and_the_capture_equals_eager(mask):
    """fp32 on CUDA: torch traces the memory-efficient kernel, with the mask as attn_bias; rewritten, the captured
    step equals the graph run eagerly bitwise, and the is_causal loop closely (another kernel runs there)."""
    step, losses, params = train(mask, compiled=True, steps=5, device="cuda", mode="full")
    assert step.captured
    report = step.report.causal_attention
    assert len(report.rewritten) == 1 and "efficient_attention" in report.rewritten[0], str(report)
    _, eager_losses, eager_params = train(mask, compiled=True, steps=5, device="cuda", mode="eager")
    assert_bitwise_equal(losses, eager_losses, "losses")
    for p, r in zip(params, eager_params):
        assert_bitwise_equal(p.detach(), r.detach(), "parameters")
    _, ref_losses, ref_params = train(None, compiled=False, steps=5, device="cuda")
    torch.testing.assert_close(losses, ref_losses)
    for p, r in zip(params, ref_params):
        torch.testing.assert_close(p.detach(), r.detach())


def test_an_unmodified_hugging_face_llama_trains_with_is_causal():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      use_cache=False)

    def llama_loss(out, targets):
        return F.cross_entropy(out.logits.flatten(0, 1), targets.flatten())

    def run(compiled):
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(config)
        gen = torch.Generator().manual_seed(1)
        data = [(torch.randint(0, 300, (2, 16), generator=gen), torch.randint(0, 300, (2, 16), generator=gen))
                for _ in range(3)]
        return run_steps(model, llama_loss, data, compiled, lr=1e-3)

    step, losses, params = run(compiled=True)
    report = step.report.causal_attention
    # Traced with fake tensors, the model materialises a causal mask (one per layer, from one shared pattern): each
    # attention op runs with is_causal instead.
    assert len(report.rewritten) == config.num_hidden_layers and not report.left_alone, str(report)
    _, ref_losses, ref_params = run(compiled=False)
    torch.testing.assert_close(losses, ref_losses)
    for p, r in zip(params, ref_params):
        torch.testing.assert_close(p.detach(), r.detach())
