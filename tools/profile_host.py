"""Development: where an eager optimizer step's host time goes (CUDA), graphsafe against torch fused.

For SGD-momentum and AdamW, one 4M tensor and 200 tensors of 20k: the whole step() (with the update kernels
counting the steps, and with a launch of their own doing it), the gathering of one group (the at-once path,
and the per-parameter path forced), issuing the core calls (both ways of counting steps), and torch's fused
step. Microseconds of host time per call, best of 7 runs of 200 calls (the GPU keeps up: these steps
are bound by the host)."""
import torch

import graphsafe.optim as go
import graphsafe.optim._base as base
from graphsafe.bench.timing import host_us_per_call


def per_call_us(fn):
    fn()  # warm
    return host_us_per_call(fn, torch.device("cuda"))


def issuing(o, group, device, pairs):
    """A function that issues the group's core calls, gathered once (by the path the step would take)."""
    issues = o._prepare_group_at_once(group) or [o._prepare_bucket(group, device, torch.float32, pairs)]
    return lambda: [issue() for issue in issues]


def make(n, numel, cls, **kw):
    params = [torch.nn.Parameter(torch.randn(numel, device="cuda")) for _ in range(n)]
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer = cls(params, **kw)
    optimizer.step()
    return optimizer


def main():
    print("| case | graphsafe step | step, steps counted by a launch of their own | at-once gather | general gather "
          "| issue | issue, steps counted by a launch of their own | torch fused step |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, cls, torch_cls, kw in (("SGD", go.SGD, torch.optim.SGD, dict(lr=1e-3, momentum=0.9)),
                                     ("AdamW", go.AdamW, torch.optim.AdamW, dict(lr=1e-3, weight_decay=1e-2))):
        for n, numel in ((1, 1 << 22), (200, 20971)):
            o = make(n, numel, cls, **kw)
            group = o.param_groups[0]
            step_us = per_call_us(o.step)
            at_once_us = per_call_us(lambda: o._prepare_group_at_once(group))
            pairs = [(p, p.grad) for p in group["params"]]
            device = pairs[0][0].device
            general_us = per_call_us(lambda: o._prepare_bucket(group, device, torch.float32, pairs))
            issue_us = per_call_us(issuing(o, group, device, pairs))
            counter = base.GraphsafeOptimizer._finish_counter
            base.GraphsafeOptimizer._finish_counter = lambda self, device: 0  # the steps counted by a launch ahead
            issue_separate_us = per_call_us(issuing(o, group, device, pairs))
            step_separate_us = per_call_us(o.step)
            base.GraphsafeOptimizer._finish_counter = counter
            t = make(n, numel, torch_cls, fused=True, **kw)
            torch_us = per_call_us(t.step)
            print(f"| {name} {n}x{numel} | {step_us:.1f} | {step_separate_us:.1f} | {at_once_us:.1f} | {general_us:.1f} "
                  f"| {issue_us:.1f} | {issue_separate_us:.1f} | {torch_us:.1f} |")


if __name__ == "__main__":
    main()
