"""Speculative decoding for GPT-2: a small model drafts, a large one verifies
(Leviathan et al. 2023; Chen et al. 2023)."""

from .acceptance import Verdict, residual_distribution, speculative_sampling, speculative_sampling_greedy
from .drafters import Draft, ModelDrafter, SimulatedDrafter
from .loop import speculative_generate
from .stats import SpecStats, expected_tokens_per_step, improvement_factor, predicted_speedup

__all__ = [
    "Draft",
    "ModelDrafter",
    "SimulatedDrafter",
    "SpecStats",
    "Verdict",
    "expected_tokens_per_step",
    "improvement_factor",
    "predicted_speedup",
    "residual_distribution",
    "speculative_generate",
    "speculative_sampling",
    "speculative_sampling_greedy",
]
