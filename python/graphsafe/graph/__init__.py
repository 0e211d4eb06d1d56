"""graphsafe.graph: trace a training step into one FX graph, rewrite it, gate it, capture it.

trace_training_step -> rewrite_embedding_backward -> fuse_sparse_embedding_update -> capture_gate -> partition_for_capture -> runners
(capture.py), tied together by compile_step (step.py); data_parallel.py adds the gradient all-reduce of a
data-parallel step to the trace. docs/graph.md and docs/multi-gpu.md explain each piece.
"""

from .capture import CaptureError, InputMismatchError
from .data_parallel import DataParallel, DataParallelPlan
from .gate import NOTES, RULES, GateReport, capture_gate
from .partition import PartitionReport, Region, partition_for_capture, run_regions
from .rewrite import RewriteReport, rewrite_embedding_backward, use_graphsafe_embeddings
from .sparse_update import SparseUpdateReport, fuse_sparse_embedding_update
from .step import MODES, CompiledStep, StepReport, compile_step
from .trace import TraceError, TracedStep, trace_training_step

__all__ = [
    "trace_training_step", "TracedStep", "TraceError",
    "rewrite_embedding_backward", "RewriteReport", "use_graphsafe_embeddings",
    "fuse_sparse_embedding_update", "SparseUpdateReport",
    "capture_gate", "GateReport", "RULES", "NOTES",
    "partition_for_capture", "PartitionReport", "Region", "run_regions",
    "compile_step", "CompiledStep", "StepReport", "MODES", "CaptureError", "InputMismatchError",
    "DataParallel", "DataParallelPlan",
]
