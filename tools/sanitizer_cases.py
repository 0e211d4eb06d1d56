"""Every graphsafe CUDA kernel family once, on small shapes that still cover their edge paths, for
compute-sanitizer (memcheck, racecheck) to watch: tools/device_check.sh runs it with SANITIZE=1.

Small on purpose: under racecheck every shared-memory access is checked, so a kernel costs orders of magnitude
more time. The shapes cover: several blocks and a partial last block, unaligned (scalar-path) tensors, empty
tensors, many tensors (several launches), every algorithm at 32/16/8-bit states with skip_zeros on and off,
8-bit block sizes 32/256/1024, the embedding backward at fp32/bf16 with padding_idx, scale_grad_by_freq,
duplicate-heavy and out-of-range indices, and the lookup; the row-sparse backward and step (every algorithm and
storage, rows of a multiple of 4 elements and not, rows sharing quantisation blocks). Exits 1 if a result is not finite where it must be.
"""

from __future__ import annotations

import sys

import torch

import graphsafe
import graphsafe.optim as go

DEVICE = "cuda" if len(sys.argv) < 2 else sys.argv[1]  # (a CPU run checks this script itself)
ALGORITHMS = {
    "Adam": dict(weight_decay=0.1, amsgrad=True),
    "AdamW": dict(),
    "SGD": dict(momentum=0.9, nesterov=True),
    "RMSprop": dict(momentum=0.5, centered=True),
    "Adagrad": dict(lr_decay=0.01),
    "Lion": dict(weight_decay=0.1),
    "LAMB": dict(weight_decay=0.01),
    "LARS": dict(weight_decay=0.01),
    "AdEMAMix": dict(t_alpha=10, t_beta3=10),
}
# Sizes: 1 element, not a multiple of the vector width, exactly one 4096-element chunk, a chunk and a bit; the
# offset view of the last starts off a 16-byte boundary (the kernels' scalar path).
SIZES = [1, 37, 4096, 4096 + 5]
# (state_bits, block_size, skip_zeros): every storage and 8-bit block size, skip_zeros on and off among them.
STORAGE = [(32, 256, False), (32, 256, True), (16, 256, True), (8, 32, True), (8, 256, False), (8, 1024, True)]


def params_for(dtype: torch.dtype, generator: torch.Generator) -> list[torch.nn.Parameter]:
    params = [torch.nn.Parameter(torch.randn(n, generator=generator).to(DEVICE, dtype)) for n in SIZES]
    backing = torch.randn(4096 + 6, generator=generator).to(DEVICE, dtype)
    params.append(torch.nn.Parameter(backing[1:]))  # unaligned
    params.append(torch.nn.Parameter(torch.empty(0, device=DEVICE, dtype=dtype)))  # empty
    return params


def optimizer_cases(failures: list[str]) -> int:
    generator = torch.Generator().manual_seed(0)
    count = 0
    for name, options in ALGORITHMS.items():
        for dtype in (torch.float32, torch.bfloat16):
            for state_bits, block_size, skip_zeros in STORAGE:
                params = params_for(dtype, generator)
                optimizer = getattr(go, name)(params, lr=1e-3, skip_zeros=skip_zeros, state_bits=state_bits,
                                              block_size=block_size, min_8bit_size=1, **options)
                for _ in range(2):
                    for p in params:
                        grad = torch.randn(p.shape, generator=generator).to(DEVICE, dtype)
                        grad[::3] = 0  # skipped elements
                        p.grad = grad
                    optimizer.step()
                if not all(torch.isfinite(p).all() for p in params):
                    failures.append(f"{name} {dtype} {state_bits}-bit block {block_size} skip_zeros={skip_zeros}")
                count += 1
    # More tensors than one launch's argument table holds (several launches), 8-bit and fp32 side by side.
    params = [torch.nn.Parameter(torch.randn(n % 300 + 1, device=DEVICE)) for n in range(0, 150 * 37, 37)]
    optimizer = go.AdamW(params, state_bits=8, min_8bit_size=128, block_size=32)
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer.step()
    return count + 1


def embedding_cases(failures: list[str]) -> int:
    generator = torch.Generator().manual_seed(1)
    count = 0
    for dtype in (torch.float32, torch.bfloat16):
        # Up to 4096 tokens the dense backward takes its small-problem path (cuda_small.cu), above it the general one
        # (no tokens: the general path's fill alone). The general path's zero fill takes rows of fewer than 32 vectors
        # and of more (D=512), num_weights not a multiple of 32 among them.
        for num_weights, dim, tokens in ((1, 8, 5), (50, 64, 1000), (1000, 257, 3000), (7, 1024, 4096),
                                         (3000, 64, 4097), (40, 24, 9000), (100, 512, 5000), (10, 64, 0)):
            hot = torch.randint(0, min(num_weights, 3), (tokens // 2,), generator=generator)
            spread = torch.randint(0, num_weights, (tokens - tokens // 2,), generator=generator)
            indices = torch.cat([hot, spread]).to(DEVICE)
            grad = torch.randn(tokens, dim, generator=generator).to(DEVICE, dtype)
            for padding_idx, scale in ((-1, False), (0, True)):
                for index_dtype in (torch.int32, torch.int64):
                    out = graphsafe.ops.embedding_backward(grad, indices.to(index_dtype), num_weights, padding_idx,
                                                           scale)
                    if not torch.isfinite(out).all():
                        failures.append(f"embedding_backward {dtype} V={num_weights} D={dim} N={tokens}")
                    count += 1
            weight = torch.randn(num_weights, dim, generator=generator).to(DEVICE, dtype)
            graphsafe.ops.embedding(weight, indices)
            count += 1
    # Out-of-range indices: on CUDA left out of the sum (nothing written out of bounds) and reported.
    bad = torch.tensor([0, 5, -1, 2], device=DEVICE)
    for op in (lambda: graphsafe.ops.embedding_backward(torch.ones(4, 16, device=DEVICE), bad, 4),
               lambda: graphsafe.ops.embedding(torch.ones(4, 16, device=DEVICE), bad)):
        try:
            op()
            graphsafe.check_errors()
            failures.append("out-of-range index not reported")
        except IndexError:  # (graphsafe.DeviceIndexError on CUDA)
            pass
    for n in (0, 1, 255, 256 * 3 + 1):
        x = torch.randn(n, device=DEVICE)
        for signed in (True, False):
            codes, absmax = graphsafe.ops.quantize_blockwise(x if signed else x.abs(), 256, signed)
            graphsafe.ops.dequantize_blockwise(codes, absmax, 256, signed)
            count += 1
    return count + 1


def sparse_cases(failures: list[str]) -> int:
    generator = torch.Generator().manual_seed(2)
    count = 0
    for num_weights, dim in ((37, 24), (50, 7)):  # (packets of 4 elements; one element per thread)
        indices = torch.randint(0, num_weights, (60,), generator=generator).to(DEVICE)
        for dtype in (torch.float32, torch.bfloat16):
            grad = torch.randn(60, dim, generator=generator).to(DEVICE, dtype)
            rows, row_grads, n = graphsafe.ops.embedding_backward_sparse(grad, indices, num_weights, 0, True)
            for name, options in ALGORITHMS.items():
                for state_bits, block_size, _ in STORAGE:
                    table = torch.nn.Parameter(torch.randn(num_weights, dim, generator=generator).to(DEVICE, dtype))
                    optimizer = getattr(go, name)([table], lr=1e-3, skip_zeros=True, state_bits=state_bits,
                                                  block_size=block_size, min_8bit_size=1, **options)
                    for _ in range(2):
                        go.sparse_step(optimizer, table, rows, row_grads, n)
                    if not torch.isfinite(table).all():
                        failures.append(f"sparse_step {name} {dtype} {num_weights}x{dim} {state_bits}-bit block "
                                        f"{block_size}")
                    count += 1
    return count


def main() -> int:
    failures: list[str] = []
    count = optimizer_cases(failures) + embedding_cases(failures) + sparse_cases(failures)
    graphsafe.check_errors()
    print(f"sanitizer cases: {count} ran, {len(failures)} failed")
    for failure in failures:
        print("FAILED", failure)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
