"""`graphsafe train` on the CPU: the loss falls, the determinism check and the MoE and recsys variants; the matmul
precision setting is scoped to CUDA runs.
"""

from __future__ import annotations

import time

import pytest
import torch


# ---------------------------------------------------------------------------------------------------------
# graphsafe train
# ---------------------------------------------------------------------------------------------------------


def _losses(text):
    return [float(line.split("loss")[1].split()[0]) for line in text.splitlines() if line.startswith("step ")]


def test_train_cli_on_cpu_loss_falls(capsys):
    from graphsafe.cli import main

    start = time.perf_counter()
    assert main(["train", "--steps", "20", "--device", "cpu"]) == 0
    elapsed = time.perf_counter() - start
    out = capsys.readouterr().out
    losses = _losses(out)
    assert len(losses) == 20
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.5, losses
    assert "mode used" in out and "rewrites" in out and "optimizer state" in out
    assert elapsed < 60


@pytest.mark.parametrize("args", [["--moe", "--optimizer", "lion", "--skip-zeros"],
                                  ["--model", "recsys", "--optimizer", "adagrad", "--state-bits", "8"]])
def test_train_cli_variants_with_determinism_check(capsys, args):
    from graphsafe.cli import main

    assert main(["train", "--steps", "4", "--device", "cpu", "--check-determinism", "--compare-torch",
                 "--vocab", "32768", *args]) == 0
    out = capsys.readouterr().out
    assert "determinism" in out and "bitwise equal" in out
    assert len(_losses(out)) >= 4


def test_train_matmul_precision_is_scoped_to_cuda_runs():
    """--matmul sets CUDA's fp32 matmul precision for the run only, keeps torch's precision queries readable
    meanwhile, and never touches a CPU run."""
    from graphsafe.trainer import default_config
    from graphsafe.trainer.run import matmul_precision

    matmul = torch.backends.cuda.matmul
    before = matmul.allow_tf32
    assert default_config("cuda").matmul == "tf32" and default_config("cpu").matmul == "ieee"
    with matmul_precision(default_config("cuda:0", matmul="tf32")):
        assert matmul.allow_tf32 and matmul.fp32_precision == "tf32"
        assert torch.get_float32_matmul_precision() == "high"
    assert matmul.allow_tf32 == before
    with pytest.raises(RuntimeError), matmul_precision(default_config("cuda", matmul="ieee")):
        assert not matmul.allow_tf32 and matmul.fp32_precision == "ieee"
        raise RuntimeError("a failed run still restores the setting")
    assert matmul.allow_tf32 == before
    with matmul_precision(default_config("cpu", matmul="tf32")):
        assert matmul.allow_tf32 == before
    with pytest.raises(SystemExit, match="unknown matmul precision"), matmul_precision(default_config("cuda", matmul="bf16")):
        pass


def test_train_recsys_fuses_its_tables_by_default(capsys):
    from graphsafe.cli import main

    small = ["train", "--steps", "3", "--device", "cpu", "--model", "recsys", "--vocab", "512", "--dim", "16",
             "--batch-size", "64"]
    assert main(small) == 0
    out = capsys.readouterr().out
    assert "embedding tables skip_zeros=True for --sparse-updates" in out
    assert "4 table(s) fused" in out
    for table in ("users", "items", "categories", "history"):
        assert f"{table}.weight [" in out
    assert main([*small, "--no-sparse-updates"]) == 0
    out = capsys.readouterr().out
    assert "off (--no-sparse-updates)" in out and "skip_zeros=True for --sparse-updates" not in out


def test_train_lm_says_why_its_tables_are_not_fused_without_skip_zeros():
    from graphsafe.trainer import default_config
    from graphsafe.trainer.run import train

    result = train(default_config("cpu", steps=1, vocab=256, dim=16, seq_len=8, layers=1, progress=False))
    refused = dict(result.step.report.sparse_update.refused)
    assert sorted(refused) == ["positions.weight", "tokens.weight"]
    assert all("skip_zeros=False" in why for why in refused.values())
