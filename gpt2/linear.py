"""The linear layers of GPT-2, y = x W^T + b, behind one function.

Legend: N = rows (B * T tokens), in/out = features.

Every matrix product of the model (attention and MLP projections, the LM head)
calls `linear`, so a faster CPU kernel can be chosen in exactly one place.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x W^T + b.

    Args:
        x: (..., in) activations.
        weight: (out, in), the `nn.Linear` layout.
        bias: (out,) or None.

    Returns:
        (..., out).
    """
    return F.linear(x, weight, bias)  # (..., in) x (in, out) -> (..., out)


class Linear(nn.Module):
    """A linear layer whose weight is (out, in) and whose product is `linear`.

    The GPT-2 checkpoint calls these Conv1D and stores them (in, out);
    loading.py transposes them into this layout.
    """

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))  # (out, in)
        self.bias = nn.Parameter(torch.empty(out_features))  # (out,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., in) -> (..., out)
        return linear(x, self.weight, self.bias)
