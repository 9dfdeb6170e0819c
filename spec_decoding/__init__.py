"""Speculative decoding for GPT-2: a small model drafts, a large one verifies
(Leviathan et al. 2023; Chen et al. 2023)."""

from .acceptance import Verdict, residual_distribution, speculative_sampling, speculative_sampling_greedy
from .costs import StepCosts, calibrate
from .drafters import Draft, Drafter, ModelDrafter, NgramDrafter, SimulatedDrafter
from .loop import speculative_generate
from .schedule import AutoGamma, FixedGamma, GammaSchedule, HeuristicGamma, best_gamma
from .stats import SpecStats, expected_tokens_per_step, improvement_factor, predicted_speedup

__all__ = [
    "AutoGamma",
    "Draft",
    "Drafter",
    "FixedGamma",
    "GammaSchedule",
    "HeuristicGamma",
    "ModelDrafter",
    "NgramDrafter",
    "SimulatedDrafter",
    "SpecStats",
    "StepCosts",
    "Verdict",
    "best_gamma",
    "calibrate",
    "expected_tokens_per_step",
    "improvement_factor",
    "predicted_speedup",
    "residual_distribution",
    "speculative_generate",
    "speculative_sampling",
    "speculative_sampling_greedy",
]
