"""One 8-bit AdamW step on 64M fp32 parameters, three times: a target for ncu on the GPU machine, e.g.
ncu --clock-control none --kernel-name regex:elementwise_kernel --launch-skip 2 --launch-count 1 \
    --section SpeedOfLight --section Occupancy --section WarpStateStats python3 tools/profile_optim8.py"""
import torch

import graphsafe.optim as go

p = torch.nn.Parameter(torch.randn(64 << 20, device="cuda"))
p.grad = torch.randn_like(p)
opt = go.AdamW([p], lr=1e-3, weight_decay=0.01, state_bits=8)
for _ in range(3):
    opt.step()
torch.cuda.synchronize()
