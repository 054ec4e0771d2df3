"""A plain multi-layer perceptron for classification or regression.

``layers.<i>.fc`` Linear(d_in or d_hidden, d_hidden) followed by GELU, repeated
``n_layers`` times (each a ``MLPBlock``, so layer detection sees repeated
blocks), then a ``head`` Linear(d_hidden, d_out).

Parameter count (elements): ``d_in d_hid + d_hid + (n_layers - 1)(d_hid^2 + d_hid)
+ d_hid d_out + d_out``. Forward FLOPs: ``2 b (d_in d_hid + (n_layers - 1) d_hid^2
+ d_hid d_out)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class MLPConfig:
    """Shape of an MLP.

    Attributes:
        d_in: input features, in elements.
        d_hidden: hidden width, in elements.
        d_out: classes (``loss="cross_entropy"``) or regression outputs (``"mse"``).
        n_layers: hidden Linear+GELU layers (at least 1).
        loss: ``"cross_entropy"`` (targets int64 [batch]) or ``"mse"``
            (targets float [batch, d_out]).
    """

    d_in: int
    d_hidden: int
    d_out: int
    n_layers: int
    loss: str = "cross_entropy"

    def __post_init__(self) -> None:
        if self.n_layers < 1:
            raise ValueError("n_layers must be at least 1")
        if self.loss not in ("cross_entropy", "mse"):
            raise ValueError(f"loss must be 'cross_entropy' or 'mse', not {self.loss!r}")

    def num_params(self) -> int:
        d_in, d, d_out = self.d_in, self.d_hidden, self.d_out
        return d_in * d + d + (self.n_layers - 1) * (d * d + d) + d * d_out + d_out

    def forward_flops(self, batch_size: int) -> float:
        d_in, d, d_out = self.d_in, self.d_hidden, self.d_out
        return float(2 * batch_size * (d_in * d + (self.n_layers - 1) * d * d + d * d_out))


class MLPBlock(nn.Module):
    """Linear(d_in, d_out) -> GELU."""

    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d_in, d_out)
        self.act = nn.GELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.fc(x))


class MLP(nn.Module):
    """``forward(x, targets)`` returns the mean loss (cross entropy or MSE).

    Args of forward:
        x: float [batch, d_in].
        targets: int64 [batch] class ids, or float [batch, d_out] for MSE; when
            ``None`` the outputs [batch, d_out] are returned.
    """

    def __init__(self, config: MLPConfig) -> None:
        super().__init__()
        self.config = config
        widths = [config.d_in] + [config.d_hidden] * config.n_layers
        self.layers = nn.ModuleList([MLPBlock(a, b) for a, b in zip(widths[:-1], widths[1:])])
        self.head = nn.Linear(config.d_hidden, config.d_out)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """PyTorch's default Linear initialisation (Kaiming-uniform weights)."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                module.reset_parameters()

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        out = self.head(x)
        if targets is None:
            return out
        if self.config.loss == "mse":
            return F.mse_loss(out, targets)
        return F.cross_entropy(out, targets)


def example_inputs(config: MLPConfig, batch_size: int, device: torch.device | str = "meta",
                   dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, targets): x float [batch_size, d_in]; targets as :class:`MLP` expects."""
    x = torch.randn(batch_size, config.d_in, device=device, dtype=dtype)
    if config.loss == "mse":
        targets = torch.randn(batch_size, config.d_out, device=device, dtype=dtype)
    else:
        targets = torch.randint(0, config.d_out, (batch_size,), dtype=torch.long, device=device)
    return x, targets
