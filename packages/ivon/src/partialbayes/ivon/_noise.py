"""The normal draw of IVON's weight samples."""

from __future__ import annotations

import torch
from torch import Tensor


def normal_(tensors: list[Tensor], std: float, generator: torch.Generator | None) -> None:
    """Fill each tensor with ``N(0, std²)`` noise: one ``normal_`` per tensor, in list order.

    Args:
        tensors: Tensors to overwrite (one device).
        std: Standard deviation.
        generator: Generator (same seed, same noise); ``None`` draws from the device's global RNG. Noise for a
            tensor on another device than the generator is drawn on the generator's device and copied.
    """
    for z in tensors:
        if generator is None or _same_device(torch.device(generator.device), z.device):
            z.normal_(0.0, std, generator=generator)
        else:
            z.copy_(
                torch.empty(z.shape, dtype=z.dtype, device=generator.device).normal_(
                    0.0, std, generator=generator
                )
            )


def _same_device(a: torch.device, b: torch.device) -> bool:
    return a.type == b.type and (a.index or 0) == (b.index or 0)
