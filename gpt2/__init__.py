"""A hand-written GPT-2 with a preallocated KV cache, the official checkpoints'
loader, the GPT-2 tokenizer, and plain autoregressive generation. The
optional C fast path for CPUs lives apart, in gpt2/fast."""

from .config import PRESETS, GPT2Config, preset
from .generate import generate
from .kv_cache import KVCache
from .loading import load_model, resolve_device, resolve_dtype
from .model import GPT2, init_random_weights
from .sampling import SamplingConfig, logits_to_probs, next_token, sample
from .tokenizer import END_OF_TEXT_ID, load_tokenizer

__all__ = [
    "END_OF_TEXT_ID",
    "GPT2",
    "GPT2Config",
    "KVCache",
    "PRESETS",
    "SamplingConfig",
    "generate",
    "init_random_weights",
    "load_model",
    "load_tokenizer",
    "logits_to_probs",
    "next_token",
    "preset",
    "resolve_device",
    "resolve_dtype",
    "sample",
]
