"""A multilayer perceptron classifier over flattened inputs.

    >>> model = MLPNet(MLPConfig(hidden=[128]))
    >>> model(torch.randn(3, 1, 8, 8)).shape      # (B, 1, 8, 8) is flattened to (B, 64)
    torch.Size([3, 10])
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kiln.models._registry import register_model

__all__ = ["MLPConfig", "MLPNet"]


@dataclass
class MLPConfig:
    in_features: int = 64  # size of one flattened input sample (8*8 for digits)
    hidden: tuple[int, ...] = (256, 256)  # width of each hidden block; one block per entry (a YAML list is fine)
    num_classes: int = 10  # size of the logits vector
    dropout: float = 0.0  # dropout after each hidden activation

    def __post_init__(self) -> None:
        if isinstance(self.hidden, int) and not isinstance(self.hidden, bool):
            raise ValueError(f"MLPConfig.hidden={self.hidden!r}: must be a list of widths, e.g. [{self.hidden}]")
        try:
            # Configs loaded from YAML give lists (or OmegaConf ListConfigs); store a tuple.
            self.hidden = tuple(self.hidden)
        except TypeError:
            raise ValueError(f"MLPConfig.hidden={self.hidden!r}: must be a list of positive integers") from None
        for name, value in [("in_features", self.in_features), ("num_classes", self.num_classes),
                            *((f"hidden[{i}]", h) for i, h in enumerate(self.hidden))]:
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"MLPConfig.{name}={value!r}: must be a positive integer")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"MLPConfig.dropout={self.dropout!r}: must be in [0, 1)")

    def example_input(self, batch_size: int, generator: torch.Generator | None = None) -> torch.Tensor:
        """Random inputs shaped ``(batch_size, in_features)``."""
        return torch.randn(batch_size, self.in_features, generator=generator)


@register_model("mlp", MLPConfig)
class MLPNet(nn.Module):
    """``blocks`` of (Linear, GELU, Dropout), then a Linear head. Any (B, ...) input is flattened to (B, F)."""

    def __init__(self, cfg: MLPConfig) -> None:
        super().__init__()
        self.cfg = cfg
        widths = (cfg.in_features, *cfg.hidden)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(w_in, w_out), nn.GELU(), nn.Dropout(cfg.dropout))
            for w_in, w_out in zip(widths[:-1], widths[1:])
        )
        self.head = nn.Linear(widths[-1], cfg.num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.flatten(1)  # (B, F)
        if flat.shape[1] != self.cfg.in_features:
            raise ValueError(
                f"MLPNet expected {self.cfg.in_features} features per sample, got input {tuple(x.shape)} "
                f"({flat.shape[1]} after flattening); set in_features={flat.shape[1]}"
            )
        x = flat
        for block in self.blocks:
            x = block(x)  # (B, hidden[i])
        return self.head(x)  # (B, num_classes)
