"""Flat layout of the stochastic entries of a model: the bridge between a ``Subset`` and one vector."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from partialbayes.selection import Subset
from partialbayes.selection.internal import check_subset


@dataclass(frozen=True)
class FlatLayout:
    """Where the stochastic entries of each parameter sit in one flat vector.

    The entries of ``names[i]`` (storage shape ``shapes[i]``, int64 positions ``indices[i]`` in its
    flattened storage) occupy ``flat[offsets[i]:offsets[i + 1]]``, in ``Subset.gather`` order.
    """

    names: tuple[str, ...]
    shapes: tuple[torch.Size, ...]
    indices: tuple[Tensor, ...]
    offsets: tuple[int, ...]

    @classmethod
    def from_subset(cls, subset: Subset) -> FlatLayout:
        """The layout of a non-empty ``partialbayes.selection.Subset``."""
        check_subset(subset, empty_ok=False)
        names = tuple(subset.names)
        shapes, indices, offsets = [], [], [0]
        for name in names:
            mask = subset.mask(name).to("cpu", torch.bool)
            idx = mask.reshape(-1).nonzero().squeeze(1)
            shapes.append(torch.Size(mask.shape))
            indices.append(idx)
            offsets.append(offsets[-1] + idx.numel())
        return cls(names, tuple(shapes), tuple(indices), tuple(offsets))

    def to(self, device: torch.device | str) -> FlatLayout:
        """The same layout with its index tensors on ``device`` (avoids a copy per gather/scatter)."""
        return FlatLayout(
            self.names, self.shapes, tuple(i.to(device) for i in self.indices), self.offsets
        )

    def same_entries(self, other: FlatLayout) -> bool:
        """Whether ``other`` selects exactly the same entries of the same parameters."""
        return (
            self.names == other.names
            and self.shapes == other.shapes
            and all(
                torch.equal(a.cpu(), b.cpu())
                for a, b in zip(self.indices, other.indices, strict=True)
            )
        )

    @property
    def size(self) -> int:
        """Number of stochastic entries ``d``."""
        return self.offsets[-1]

    def gather(self, tensors: Mapping[str, Tensor], dtype: torch.dtype | None = None) -> Tensor:
        """The stochastic entries of storage-shaped ``tensors`` as one ``(d,)`` vector (default dtype: theirs)."""
        first = tensors[self.names[0]]
        flat = torch.empty(
            self.size, dtype=first.dtype if dtype is None else dtype, device=first.device
        )
        for i, (name, idx) in enumerate(zip(self.names, self.indices, strict=True)):
            t = tensors[name].detach().reshape(-1)
            idx = idx if idx.device == t.device else idx.to(t.device)
            part = flat[self.offsets[i] : self.offsets[i + 1]]
            if t.dtype == flat.dtype and t.device == flat.device:
                torch.index_select(t, 0, idx, out=part)  # no temporary, no torch.cat
            else:
                part.copy_(torch.index_select(t, 0, idx))
        return flat

    def scatter_(self, params: Mapping[str, Tensor], flat: Tensor) -> None:
        """Write ``flat`` ``(d,)`` into the stochastic entries of ``params``, in place."""
        with torch.no_grad():
            for i, (name, idx) in enumerate(zip(self.names, self.indices, strict=True)):
                p = params[name]
                idx = idx if idx.device == p.device else idx.to(p.device)
                values = flat[self.offsets[i] : self.offsets[i + 1]].to(p.device, p.dtype)
                if p.is_contiguous():  # unique indices: scatter_ is much faster than index_copy_
                    p.view(-1).scatter_(0, idx, values)
                else:
                    tmp = p.detach().reshape(-1).clone()
                    tmp.index_copy_(0, idx, values)
                    p.copy_(tmp.view(p.shape))

    def unflatten(self, flat: Tensor) -> dict[str, Tensor]:
        """Split ``flat`` (shape ``(..., d)``) into per-parameter value vectors (``Subset.gather`` order)."""
        return {
            name: flat[..., self.offsets[i] : self.offsets[i + 1]]
            for i, name in enumerate(self.names)
        }
