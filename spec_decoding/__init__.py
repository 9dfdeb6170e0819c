"""Speculative decoding for GPT-2: a small model drafts, a large one verifies
(Leviathan et al. 2023; Chen et al. 2023), a chain of tokens or a token tree
(SpecInfer, Miao et al. 2024)."""

from .acceptance import Verdict, residual_distribution, speculative_sampling, speculative_sampling_greedy
from .batch import batch_speculative_generate
from .batch_drafters import BatchDraft, BatchDrafter, SimulatedBatchDrafter
from .costs import StepCosts, calibrate
from .drafters import Draft, Drafter, ModelDrafter, NgramDrafter, SimulatedDrafter
from .loop import speculative_generate
from .schedule import AutoGamma, FixedGamma, GammaSchedule, HeuristicGamma, best_gamma
from .stats import BatchStats, SpecStats, expected_tokens_per_step, improvement_factor, predicted_speedup
from .tree import DEFAULT_TREE, TokenTree, TreeShape
from .tree_acceptance import TreeVerdict, tree_greedy, tree_sampling
from .tree_drafting import SimulatedTreeDrafter, TreeDraft, TreeDrafter
from .tree_loop import tree_speculative_generate

__all__ = [
    "AutoGamma",
    "BatchDraft",
    "BatchDrafter",
    "BatchStats",
    "DEFAULT_TREE",
    "Draft",
    "Drafter",
    "FixedGamma",
    "GammaSchedule",
    "HeuristicGamma",
    "ModelDrafter",
    "NgramDrafter",
    "SimulatedBatchDrafter",
    "SimulatedDrafter",
    "SimulatedTreeDrafter",
    "SpecStats",
    "StepCosts",
    "TokenTree",
    "TreeDraft",
    "TreeDrafter",
    "TreeShape",
    "TreeVerdict",
    "Verdict",
    "batch_speculative_generate",
    "best_gamma",
    "calibrate",
    "expected_tokens_per_step",
    "improvement_factor",
    "predicted_speedup",
    "residual_distribution",
    "speculative_generate",
    "speculative_sampling",
    "speculative_sampling_greedy",
    "tree_greedy",
    "tree_sampling",
    "tree_speculative_generate",
]
