"""One AdamW step on 64M parameters, three times: a target for ncu on the GPU machine, e.g.
ncu --clock-control none --kernel-name regex:quantized_elementwise_kernel --launch-skip 2 --launch-count 1 \
    --section SpeedOfLight --section Occupancy --section WarpStateStats python3 tools/profile_optim8.py [dtype] [bits]
dtype: float32 (default), bfloat16 or float16; bits: 8 (default) or 32 (the state_bits option)."""
import sys

import torch

import graphsafe.optim as go

dtype = getattr(torch, sys.argv[1]) if len(sys.argv) > 1 else torch.float32
bits = int(sys.argv[2]) if len(sys.argv) > 2 else 8
p = torch.nn.Parameter(torch.randn(64 << 20, device="cuda", dtype=dtype))
p.grad = torch.randn_like(p)
opt = go.AdamW([p], lr=1e-3, weight_decay=0.01, state_bits=bits)
for _ in range(3):
    opt.step()
torch.cuda.synchronize()
