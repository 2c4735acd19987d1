"""Llama models that hide a sequence mixer outside attention, for the closed-world guard's tests.

Each replaces layer 0's MLP of a tiny ``LlamaForCausalLM`` (real transformers code) with one that
also mixes tokens along the sequence — a running sum, a depthwise causal convolution, a token shift
written with slicing inside a custom leaf module — or with a custom leaf that is truly position-wise
but unknown to the guard (``TokenScale``: refused until declared).
"""

from __future__ import annotations

import torch
from models import tiny_model
from torch import nn
from transformers.models.llama.modeling_llama import LlamaMLP


class CumsumMLP(LlamaMLP):
    """A Llama MLP whose output is the running mean over the positions so far (a scan)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [B, S, h]
        steps = torch.arange(1, x.shape[1] + 1, dtype=x.dtype)[None, :, None]
        return super().forward(x).cumsum(dim=1) / steps


class ConvMLP(nn.Module):
    """A Llama MLP followed by a depthwise causal Conv1d of kernel 3 (an LFM2-style short conv)."""

    def __init__(self, config) -> None:
        super().__init__()
        self.mlp = LlamaMLP(config)
        h = config.hidden_size
        self.conv = nn.Conv1d(h, h, kernel_size=3, groups=h, padding=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [B, S, h]
        y = self.conv(self.mlp(x).transpose(1, 2))[..., : x.shape[1]]  # [B, h, S] causal
        return y.transpose(1, 2)


class TokenShift(nn.Module):
    """Each token gets the previous token's features (RWKV's time shift), written with slicing."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [B, S, h]
        return torch.cat([torch.zeros_like(x[:, :1]), x[:, :-1]], dim=1)


class TokenScale(nn.Module):
    """Truly position-wise (a fixed per-channel scale held in a buffer), but unknown to the guard."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.register_buffer("factor", torch.linspace(0.5, 1.5, hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.factor


class MLPThen(nn.Module):
    """``after(mlp(x))``: a Llama MLP followed by a leaf module."""

    def __init__(self, config, after: nn.Module) -> None:
        super().__init__()
        self.mlp = LlamaMLP(config)
        self.after = after

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.after(self.mlp(x))


def hidden_mixer_llama(kind: str, seed: int = 0) -> nn.Module:
    """A tiny fp32 Llama (eager attention) whose layer 0 MLP is ``kind``: ``cumsum``, ``conv``,
    ``shift`` (a ``TokenShift`` leaf) or ``scale`` (a position-wise ``TokenScale`` leaf)."""
    model = tiny_model("llama", seed=seed, hidden=32, vocab=128, attn="eager")
    config = model.config
    torch.manual_seed(seed + 1)
    mlp = {
        "cumsum": lambda: CumsumMLP(config),
        "conv": lambda: ConvMLP(config),
        "shift": lambda: MLPThen(config, TokenShift()),
        "scale": lambda: MLPThen(config, TokenScale(config.hidden_size)),
    }[kind]()
    with torch.no_grad():
        for p in mlp.parameters():
            p.normal_(0, 0.2)
    model.model.layers[0].mlp = mlp
    return model.eval()
