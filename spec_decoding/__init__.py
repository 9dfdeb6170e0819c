"""Speculative decoding for GPT-2: a small model drafts, a large one verifies
(Leviathan et al. 2023; Chen et al. 2023)."""

from .acceptance import Verdict, residual_distribution, speculative_sampling, speculative_sampling_greedy
from .batch import batch_speculative_generate
from .batch_drafters import BatchDraft, BatchDrafter, SimulatedBatchDrafter
from .drafters import Draft, ModelDrafter, SimulatedDrafter
from .loop import speculative_generate
from .stats import BatchStats, SpecStats, expected_tokens_per_step, improvement_factor, predicted_speedup

__all__ = [
    "BatchDraft",
    "BatchDrafter",
    "BatchStats",
    "Draft",
    "ModelDrafter",
    "SimulatedBatchDrafter",
    "SimulatedDrafter",
    "SpecStats",
    "Verdict",
    "batch_speculative_generate",
    "expected_tokens_per_step",
    "improvement_factor",
    "predicted_speedup",
    "residual_distribution",
    "speculative_generate",
    "speculative_sampling",
    "speculative_sampling_greedy",
]
