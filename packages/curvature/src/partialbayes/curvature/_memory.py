"""Memory known before it is spent: a pre-flight estimate of a fit and its predictive, and its check."""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor, nn

from partialbayes.curvature._likelihood import (
    FISHERS,
    OVERSAMPLE,
    CurvatureOptions,
    Outputs,
    model_device,
    read_batch,
    resolve_shift_labels,
)
from partialbayes.predictive.internal import (
    available_memory,
    check_int,
    check_target_ids,
    model_logits,
    output_logits,
)
from partialbayes.selection import Subset
from partialbayes.selection.internal import KronModule


def fmt_bytes(n: float) -> str:
    """``n`` bytes in binary units (``"1.50 GiB"``)."""
    k = 0
    while abs(n) >= 1024 and k < 3:
        n, k = n / 1024, k + 1
    return f"{n:.0f} B" if k == 0 else f"{n:.2f} {('KiB', 'MiB', 'GiB')[k - 1]}"


#: The exact Fisher is refused above this many outputs ``C``: it costs ``C`` backward passes per batch where
#: ``fisher="mc"`` costs ``k`` (thousands of times a training step here, for what ``mc`` estimates without
#: bias). Every LM vocabulary is above (30k–128k tokens), every common classifier below (≤ 1,000 classes).
EXACT_MAX_OUTPUTS = 8192


def check_exact_fisher(rows: Tensor, groups: int, batch_index: int) -> None:
    """Refuse ``fisher="exact"`` above `EXACT_MAX_OUTPUTS` outputs or past the memory (rows ``[N, C]``)."""
    n, c = rows.shape
    nbytes = c * n * c * rows.element_size()
    avail, source = available_memory(rows.device)
    too_big = avail is not None and nbytes > avail
    if c <= EXACT_MAX_OUTPUTS and not too_big:
        return
    why = f"more than the {fmt_bytes(avail or 0)} available ({source})" if too_big else "too many"
    raise ValueError(
        f"batch {batch_index}: fisher='exact' on {c} outputs costs {c * groups:,} backward passes for "
        f"this batch and {fmt_bytes(nbytes)} of output vectors [C, N, C] = [{c}, {n}, {c}], {why} "
        f"(refused above {EXACT_MAX_OUTPUTS} outputs). Use fisher='mc' (mc_samples sampled labels: that "
        "many passes, an unbiased estimate) or fisher='empirical' (the true labels: one pass), or score "
        "only the answer tokens (an answer-only head over target_ids: K outputs instead of C)"
    )


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes a fit and its predictive allocate; the peak is ``factors + eigen + max(fit_batch, predictive)``.

    Attributes:
        factors: Factor sums (or sketches), held through the fit.
        eigen: Eigendecompositions, plus the transient of the largest.
        fit_batch: One batch's working set of the fit (``fisher`` as given).
        predictive: One batch's working set of the linearised predictive (``K`` outputs as given).
        largest: The largest factor, e.g. ``"G of 'lm_head' (50257 x 50257)"``.
        available: Free bytes on the device (``None``: unknown), and ``source``, where that comes from.
        itemsize: Bytes per stored entry (8: float64 factors, 4: float32).
    """

    factors: int
    eigen: int
    fit_batch: int
    predictive: int
    largest: str
    available: int | None
    source: str
    itemsize: int = 8

    @property
    def total(self) -> int:
        """The peak: ``factors + eigen + max(fit_batch, predictive)``."""
        return self.factors + self.eigen + max(self.fit_batch, self.predictive)

    def __str__(self) -> str:
        avail = "unknown" if self.available is None else fmt_bytes(self.available)
        rows = [
            ("factors", self.factors, f"largest: {self.largest}"),
            ("eigendecompositions", self.eigen, ""),
            ("fit, per batch", self.fit_batch, ""),
            ("predictive, per batch", self.predictive, ""),
            ("peak", self.total, f"available: {avail} ({self.source})"),
        ]
        return "\n".join(f"{n:22s} {fmt_bytes(b):>11s}  {note}".rstrip() for n, b, note in rows)

    def check(self, max_memory: int | None = None) -> None:
        """Refuse a run whose peak exceeds ``max_memory`` bytes (default: the available memory).

        A ``max_memory`` above the available memory is warned about, and the available memory is the limit.

        Raises:
            TypeError: ``max_memory`` not an int number of bytes (``"1GB"``, ``True``, a float).
            ValueError: ``max_memory`` not positive; a peak above the limit, with the estimate and what to
                change (nothing is allocated).
        """
        if max_memory is not None:
            check_int("max_memory", max_memory)  # bytes: 8 * 2**30 for 8 GiB, never "8GB"
        limit = self.available if max_memory is None else max_memory
        if max_memory is not None and self.available is not None and max_memory > self.available:
            warnings.warn(
                f"max_memory={fmt_bytes(max_memory)} is more than the {fmt_bytes(self.available)} "
                f"available ({self.source}): the available memory is the limit",
                stacklevel=2,
            )
            limit = self.available
        if limit is None or self.total <= limit:
            return
        fixes = {
            "Factors: keep large ones low-rank (max_rank) or fit S-KFAC (sparse_kfac(model, p): about "
            "(p/100)² of the memory)"
            + (
                ", or dtype=torch.float32 (half the bytes)." if self.itemsize > 4 else "."
            ): self.factors + self.eigen,
            "Fit: fisher='mc' or 'empirical' (k or 1 backward passes per batch, not C), smaller "
            "batches.": self.fit_batch,
            "Predictive: only the answer tokens (target_ids), or chunk_size.": self.predictive,
        }
        raise ValueError(
            f"this needs about {fmt_bytes(self.total)} but {fmt_bytes(limit)} is "
            f"{'allowed (max_memory)' if limit == max_memory else 'available'}:\n{self}\n"
            f"Refused before allocating. {' '.join(fix for fix, n in fixes.items() if n)}"
        )


def memory_estimate(
    model: nn.Module,
    subset: Subset,
    batch: Any,
    *,
    likelihood: str = "classification",
    fisher: str = "exact",
    mc_samples: int = 1,
    sharing: str | None = None,
    dtype: torch.dtype = torch.float64,
    max_rank: int | None = None,
    target_ids: Sequence[int] | Tensor | None = None,
    logits: Tensor | None = None,
) -> MemoryEstimate:
    """Estimate the memory of a Kronecker Laplace fit and its predictive, before running them.

    ``batch`` is the loader's largest batch; ``likelihood``, ``fisher``, ``mc_samples``, ``sharing``, ``dtype``
    and ``max_rank`` are the fit's (as in `kfac` and `KronLaplace`); ``target_ids`` the outputs the predictive
    covers (``None``: all ``C``); ``logits`` the batch's logits if known (else one forward pass without
    gradients is run). A causal LM's label shift is detected from the model's class.

    Returns:
        The `MemoryEstimate`: ``print`` it; ``.check()`` refuses what does not fit.

    Raises:
        ValueError: Bad options (as `kfac`; ``max_rank`` a positive int or ``None``).
    """
    options = CurvatureOptions(
        likelihood=likelihood,
        fisher=fisher,
        mc_samples=mc_samples,
        sharing=sharing,
        dtype=dtype,
        max_rank=max_rank,
    )
    device = model_device(model)
    inputs, outputs = read_batch(
        batch, device, likelihood=likelihood, shift=resolve_shift_labels(model, None)
    )
    if logits is None:
        with torch.no_grad():
            logits = model_logits(model, inputs)
    n_cls = logits.shape[-1]
    k_out = n_cls if target_ids is None else len(check_target_ids(target_ids, n_cls))
    keep = outputs.keep(logits[..., :0])
    mask = outputs.attention_mask
    return batch_estimate(logits, keep, mask, options, k_out, kmods=subset.kron_modules())


def batch_estimate(
    logits: Tensor,
    keep: Tensor | None,
    mask: Tensor | None,
    options: CurvatureOptions,
    k_out: int,
    kmods: Mapping[str, KronModule] | None = None,
    entries: tuple[int, bool] | None = None,
) -> MemoryEstimate:
    """`memory_estimate` from a batch's logits ``[B, (T,) C]``, kept positions and attention mask.

    The curvature: the Kronecker blocks ``kmods``, or ``entries = (P, dense)``, a diagonal or dense one over
    ``P`` entries. The batch's own share: its ``S`` passes' output vectors and logits' gradients.
    """
    b, n_cls = logits.shape[0], logits.shape[-1]
    n_kept = b if keep is None else int(keep.sum())
    t = logits.shape[1] if keep is not None else (1 if mask is None else mask.shape[1])
    fisher = FISHERS[options.fisher]
    passes = n_cls if fisher.per_class else options.mc_samples if fisher.sampled else 1
    item, mitem = torch.finfo(options.dtype).bits // 8, logits.element_size()
    fit = (passes * n_kept * n_cls + 3 * b * t * n_cls) * mitem
    pred = n_kept * k_out * k_out * item
    if entries is not None:
        p, dense = entries
        rounds = 1 if keep is None or fisher.sampled else int(keep.sum(1).max())
        fit += ((passes * rounds * b if dense else 2 * b) * p + (p * p if dense else p)) * item
        pred += 3 * n_kept * k_out * p * item
        stored, eigen = (p * p * item, (4 * p * p + p) * item) if dense else (p * item, 0)
        largest = f"{'H' if dense else 'diagonal'} of {p} entries"
        return MemoryEstimate(
            stored, eigen, fit, pred, largest, *available_memory(logits.device), item
        )
    sharing, max_rank = options.sharing, options.max_rank
    rows = b if (sharing or ("reduce" if keep is None else "expand")) == "reduce" else b * t
    factors = eigen = transient = 0
    largest, size = "", 0
    for name, k in (kmods or {}).items():
        r, c = k.n_rows, k.n_cols + (k.bias_name is not None)
        for side, n in (("G", r), ("A", c)):
            if max_rank is not None and n > max_rank:
                q = min(n, max_rank + OVERSAMPLE)
                factors += 2 * n * q * item
                eigen += (n * max_rank + max_rank) * item
                transient = max(transient, 3 * n * q * item)
            else:
                factors += n * n * item
                eigen += (n * n + n) * item
                transient = max(transient, 3 * n * n * item)
            if n > size:
                largest, size = f"{side} of {name!r} ({n} x {n})", n
        fit += (b * t * (c + k.n_out) + passes * rows * r) * mitem
        pred += k_out * b * t * r * mitem + b * t * c * mitem if k_out else 0
    avail, source = available_memory(logits.device)
    return MemoryEstimate(factors, eigen + transient, fit, pred, largest, avail, source, item)


@contextmanager
def sized(posteriors: Sequence[Any], outputs: Outputs) -> Iterator[None]:
    """Refuse, right after the model's forward pass, a predictive of any of ``posteriors`` that memory cannot hold."""

    def check(module: nn.Module, args: Any, output: Any) -> None:
        logits = output_logits(output)
        k = logits.shape[-1] if outputs.target_ids is None else len(outputs.target_ids)
        for p in posteriors:
            est = p._estimate(logits, outputs.keep(logits), outputs.attention_mask, k)
            replace(est, factors=0, eigen=0, fit_batch=0).check(p.max_memory)

    handle = posteriors[0].model.register_forward_hook(check)
    try:
        yield
    finally:
        handle.remove()
