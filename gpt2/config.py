"""GPT-2 hyperparameters (Radford et al. 2019, "Language Models are Unsupervised
Multitask Learners", Table 2) as one frozen dataclass.

The field names follow GPT-2's own hyperparameters (n_ctx, which nanoGPT
calls block_size) and Hugging Face's (layer_norm_epsilon); `from_hf_config`
reads the `config.json` that ships beside every Hugging Face GPT-2
checkpoint, and refuses the settings that would make a checkpoint compute
something this model does not (`GPT2_SETTINGS`).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path


# config.json fields that change the function a checkpoint computes, with the
# values this hand-written GPT-2 implements: GPT-2's own, which are also
# transformers' defaults, so an absent field is fine. `n_inner` (the MLP's
# width, null for 4 * n_embd) is checked apart, as it depends on n_embd.
# `reorder_and_upcast_attn` is allowed either way: it only computes the
# attention scores in float32 (the same function, rounded differently in
# float16/bfloat16).
GPT2_SETTINGS: dict[str, tuple] = {
    "activation_function": ("gelu_new", "gelu_pytorch_tanh"),  # two names of GELU's tanh approximation
    "scale_attn_weights": (True,),  # scores q k^T divided by sqrt(hs)
    "scale_attn_by_inverse_layer_idx": (False,),  # and not also by layer + 1
    "add_cross_attention": (False,),  # a decoder only: no encoder to attend to
    "tie_word_embeddings": (True,),  # the LM head is wte, no lm_head.weight of its own
}


MAX_SIZE = 2**31 - 1  # the most any size may be: far past every GPT-2, and an int32 like torch's index math


@dataclass(frozen=True)
class GPT2Config:
    """The shape of a GPT-2 model.

    Attributes:
        n_layer: number of transformer blocks.
        n_head: attention heads per block (nh).
        n_embd: residual stream width (C); head size hs = n_embd // n_head.
        n_ctx: context window, the number of learned positions in `wpe`
            (`n_positions` in `config.json`).
        vocab_size: number of tokens (V); 50257 for every OpenAI GPT-2.
        layer_norm_epsilon: the epsilon of every LayerNorm.
    """

    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    n_ctx: int = 1024
    vocab_size: int = 50257
    layer_norm_epsilon: float = 1e-5

    def __post_init__(self) -> None:
        for name in ("n_layer", "n_head", "n_embd", "n_ctx", "vocab_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_SIZE:
                raise ValueError(f"GPT2Config.{name} must be a positive integer (at most 2**31 - 1), got {value!r}")
        eps = self.layer_norm_epsilon
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 < eps <= sys.float_info.max:
            raise ValueError(f"GPT2Config.layer_norm_epsilon must be a positive number such as 1e-5, got {eps!r:.40}")
        object.__setattr__(self, "layer_norm_epsilon", float(eps))
        if self.n_embd % self.n_head != 0:
            raise ValueError(
                f"GPT2Config.n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})"
            )

    @property
    def head_size(self) -> int:
        return self.n_embd // self.n_head

    @classmethod
    def from_hf_config(cls, path: str | Path) -> "GPT2Config":
        """Builds the config from a Hugging Face `config.json`.

        Raises:
            FileNotFoundError: the file does not exist.
            ValueError: the file is not JSON or is not a GPT-2 config, or
                sets a field of `GPT2_SETTINGS` (or n_inner) to a value this
                model does not implement.
        """
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(
                f"{path} not found: a model folder needs the config.json that ships with the checkpoint"
            )
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except OSError as e:
            raise ValueError(f"cannot read {path} ({e.strerror or type(e).__name__}): check its permissions") from None
        except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            raise ValueError(f"{path} is not valid JSON ({str(e)[:100]}); re-download it or fix the file") from None
        if not isinstance(raw, dict):
            raise ValueError(f"{path} must hold a JSON object with the GPT-2 hyperparameters")
        model_type = raw.get("model_type", "gpt2")
        if model_type != "gpt2":
            raise ValueError(f"{path} describes a '{model_type}' model; only GPT-2 checkpoints are supported")
        try:
            config = cls(
                n_layer=raw["n_layer"],
                n_head=raw["n_head"],
                n_embd=raw["n_embd"],
                n_ctx=raw.get("n_positions", raw.get("n_ctx", 1024)),
                vocab_size=raw["vocab_size"],
                layer_norm_epsilon=raw.get("layer_norm_epsilon", 1e-5),
            )
        except KeyError as e:
            raise ValueError(f"{path} lacks the GPT-2 field {e}; is it a GPT-2 config.json?") from None
        except ValueError as e:  # a field of the wrong kind
            raise ValueError(f"{path}: {e}") from None
        check_gpt2_settings(raw, config, path)
        return config

    def to_hf_dict(self) -> dict:
        """The `config.json` fields a Hugging Face GPT-2 checkpoint carries."""
        return {
            "model_type": "gpt2",
            "architectures": ["GPT2LMHeadModel"],
            "n_layer": self.n_layer,
            "n_head": self.n_head,
            "n_embd": self.n_embd,
            "n_positions": self.n_ctx,
            "n_ctx": self.n_ctx,
            "vocab_size": self.vocab_size,
            "layer_norm_epsilon": self.layer_norm_epsilon,
            "activation_function": "gelu_new",
            "bos_token_id": 50256,
            "eos_token_id": 50256,
        }

    def to_hf_inference_dict(self) -> dict:
        """`to_hf_dict` for building transformers' GPT-2 as a reference in
        tests and benchmarks: no dropout, and no special token ids (they
        would lie outside a tiny vocabulary, and no run should stop early)."""
        no_dropout = {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
        return {**self.to_hf_dict(), **no_dropout, "bos_token_id": None, "eos_token_id": None}


def check_gpt2_settings(raw: dict, config: GPT2Config, path: Path) -> None:
    """Refuses a config.json (`raw`, read from `path`) that asks for a variant
    of GPT-2 this model does not compute: loaded anyway, the checkpoint's
    weights would silently give a different function.

    Raises:
        ValueError: naming the field, its value and the supported one.
    """
    unsupported = "which this hand-written GPT-2 does not implement: only GPT-2's own settings are supported"
    for field, supported in GPT2_SETTINGS.items():
        if field in raw and raw[field] not in supported:
            raise ValueError(
                f'{path} sets "{field}": {json.dumps(raw[field])}, {unsupported} '
                f'("{field}": {json.dumps(supported[0])}, or leave the field out)'
            )
    width = 4 * config.n_embd
    if raw.get("n_inner") not in (None, width):
        raise ValueError(
            f'{path} sets "n_inner": {json.dumps(raw["n_inner"])}, {unsupported} '
            f'(an MLP 4 * n_embd = {width} wide: "n_inner": null or {width}, or leave the field out)'
        )


# The published checkpoints' shapes: handy for benchmarks with random weights.
PRESETS: dict[str, GPT2Config] = {
    "gpt2": GPT2Config(n_layer=12, n_head=12, n_embd=768),  # 124M
    "gpt2-medium": GPT2Config(n_layer=24, n_head=16, n_embd=1024),  # 355M
    "gpt2-large": GPT2Config(n_layer=36, n_head=20, n_embd=1280),  # 774M
    "gpt2-xl": GPT2Config(n_layer=48, n_head=25, n_embd=1600),  # 1558M
    "distilgpt2": GPT2Config(n_layer=6, n_head=12, n_embd=768),  # 82M
}


def preset(name: str) -> GPT2Config:
    """The config of a published checkpoint, by its short name (`gpt2-large`) or
    Hub id (`openai-community/gpt2-large`, `distilbert/distilgpt2`)."""
    short = name.rsplit("/", 1)[-1] if isinstance(name, str) else None
    if short not in PRESETS:
        raise ValueError(f"no preset named '{name}'; choose one of {', '.join(PRESETS)}")
    return PRESETS[short]
