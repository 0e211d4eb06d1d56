"""`graphsafe train`: demo models, synthetic data and the training driver (see run.py)."""

from .run import OPTIMIZERS, TrainConfig, TrainResult, default_config, train

__all__ = ["OPTIMIZERS", "TrainConfig", "TrainResult", "default_config", "train"]
