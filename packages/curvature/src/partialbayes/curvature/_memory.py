"""Memory known before it is spent: a pre-flight estimate of a Kronecker fit and predictive, and its check.

For Kronecker modules with blocks ``r × c`` (``|R| × |C|`` under S-KFAC, ``c + 1`` with the bias folded in),
``B`` examples of ``T`` positions, ``N`` kept outputs of ``C`` logits, ``S`` backward passes per batch (``C``
for the exact Fisher, ``k`` for ``mc``, 1 for ``empirical``) and ``K`` predicted outputs (``C``, or the
answer tokens ``target_ids``), the estimate counts, in bytes:

* **factors** — the running sums ``Σ δδᵀ`` ``[r, r]``, ``Σ xxᵀ`` ``[c, c]`` and ``Σ x`` of every module, held
  for the whole fit; a side larger than ``max_rank`` keeps its Nyström sketch and test matrix instead
  (``2 n q``, ``q = max_rank + oversample``, see ``_lowrank``);
* **eigendecompositions** — the eigenvectors and eigenvalues of every factor (``n² + n``; ``n r + r`` for a
  low-rank side), plus the transient of the largest: the symmetrised copy and LAPACK's ``syevd`` workspace
  (``3 n²``; ``3 n q`` for a sketch);
* **fit working set**, per batch — the fisher's output vectors ``[S, N, C]``, the probabilities and one
  cotangent, the recorded inputs ``B T c``, one backward pass's output gradients of every module and the
  ``S`` passes' gradient rows kept until the batch is summed (``S B T r``; ``S B r`` under ``reduce``);
* **predictive**, per batch — the ``K`` backward passes' output gradients of every module (``K B T r``), the
  recorded inputs and the covariances ``[N, K, K]``.

The peak is taken as ``factors + eigendecompositions + max(fit working set, predictive)`` (upper side: a
fit frees its sums once decomposed). The model, its weights and its own forward activations are not counted:
they are what a training step of the model holds already. `check` compares the peak with the device's free
memory (CPU: ``MemAvailable`` of ``/proc/meminfo``, else the free physical pages; CUDA: free plus cached
memory) or a ``max_memory`` the caller gives, and refuses with a ``ValueError`` — a bad choice of options
for this machine, not a failed allocation — that names the numbers and what to change, before any memory is
spent.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from partialbayes.curvature._likelihood import model_device
from partialbayes.curvature._outputs import read_batch, resolve_shift_labels
from partialbayes.predictive import model_logits
from partialbayes.selection import Subset


def fmt_bytes(n: float) -> str:
    """``n`` bytes in binary units (``"1.50 GiB"``)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} B" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError  # pragma: no cover


#: The exact Fisher is refused above this many outputs ``C``. It costs ``C`` backward passes per batch (per
#: kept position when positions go one at a time) where ``fisher="mc"`` costs ``k``: at 8,192 that is thousands
#: of times a training step, for a quantity the MC Fisher estimates without bias. Every language-model
#: vocabulary is above (BERT 30,522, Llama 32,000, GPT-2 50,257), every common classifier below (1,000).
EXACT_MAX_OUTPUTS = 8192


def check_exact_fisher(rows: Tensor, groups: int, batch_index: int) -> None:
    """Refuse ``fisher="exact"`` on a large output from the batch's output rows, before any backward pass.

    Args:
        rows: ``[N, C]`` output rows of the batch.
        groups: Backward passes per output vector: 1 when every kept position goes in one pass, else the
            number of position groups.
        batch_index: Named in the error.

    Raises:
        ValueError: Above `EXACT_MAX_OUTPUTS` outputs, or when the output vectors ``[C, N, C]`` alone exceed
            the available memory; names the cost and the alternatives.
    """
    n, c = rows.shape
    nbytes = c * n * c * rows.element_size()
    avail, source = available_memory(rows.device)
    too_big = avail is not None and nbytes > avail
    if c <= EXACT_MAX_OUTPUTS and not too_big:
        return
    why = (
        f"more than the {fmt_bytes(avail or 0)} available ({source})"
        if too_big
        else (f"refused above {EXACT_MAX_OUTPUTS} outputs")
    )
    raise ValueError(
        f"batch {batch_index}: fisher='exact' on {c} outputs costs {c * groups:,} backward passes for "
        f"this batch and {fmt_bytes(nbytes)} of output vectors [C, N, C] = [{c}, {n}, {c}], {why}. Use "
        "fisher='mc' (mc_samples sampled labels: that many passes, an unbiased estimate) or "
        "fisher='empirical' (the true labels: one pass), or score only the answer tokens (an answer-only "
        "head over target_ids: K outputs instead of C)"
    )


def available_memory(device: torch.device | str) -> tuple[int | None, str]:
    """Bytes free for new tensors on ``device``, and where the number comes from (``None``: unknown)."""
    dev = torch.device(device)
    if dev.type == "cuda":
        free, _ = torch.cuda.mem_get_info(dev)
        cached = torch.cuda.memory_reserved(dev) - torch.cuda.memory_allocated(dev)
        return free + cached, "free + cached CUDA memory"
    if dev.type != "cpu":
        return None, f"unknown on {dev.type}"
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024, "MemAvailable in /proc/meminfo"
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "free physical pages"
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
        return None, "unknown"


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes a Kronecker curvature fit and its predictive allocate (see the module docstring for each part).

    Attributes:
        factors: Running factor sums (or sketches) of every module, held through the fit.
        eigen: Eigendecompositions, plus the transient of the largest.
        fit_batch: One batch's working set of the fit (output vectors, gradients).
        predictive: One batch's working set of the linearised predictive.
        largest: The largest factor, e.g. ``"G of 'lm_head' (50257 x 50257)"``.
        fisher: The fisher type estimated.
        outputs: ``K``, the outputs the predictive covers.
        available: Free bytes on the device (``None``: unknown).
        source: Where ``available`` comes from.
    """

    factors: int
    eigen: int
    fit_batch: int
    predictive: int
    largest: str
    fisher: str
    outputs: int
    available: int | None
    source: str

    @property
    def total(self) -> int:
        """The peak: ``factors + eigen + max(fit_batch, predictive)``."""
        return self.factors + self.eigen + max(self.fit_batch, self.predictive)

    def __str__(self) -> str:
        avail = "unknown" if self.available is None else fmt_bytes(self.available)
        rows = [
            ("factors", self.factors, f"largest: {self.largest}"),
            ("eigendecompositions", self.eigen, ""),
            ("fit, per batch", self.fit_batch, f"fisher={self.fisher!r}"),
            ("predictive, per batch", self.predictive, f"{self.outputs} outputs"),
            ("peak", self.total, f"available: {avail} ({self.source})"),
        ]
        return "\n".join(
            f"{name:22s} {fmt_bytes(b):>11s}  {note}".rstrip() for name, b, note in rows
        )

    def check(self, max_memory: int | None = None) -> None:
        """Refuse a run whose peak exceeds ``max_memory`` bytes (default: the available memory).

        Raises:
            ValueError: With the estimate and what to change (nothing is allocated).
        """
        limit = self.available if max_memory is None else max_memory
        if limit is None or self.total <= limit:
            return
        fixes = []
        if self.factors + self.eigen > limit // 2:
            fixes.append(
                "keep large factors low-rank (max_rank), fit S-KFAC (sparse_kfac(model, p): about "
                "(p/100)² of the factor memory) or accumulate in dtype=torch.float32 (half)"
            )
        if self.fisher == "exact" and self.fit_batch > limit // 4:
            fixes.append("fisher='mc' or 'empirical' (k or 1 backward passes per batch, not C)")
        if self.predictive > limit // 4:
            fixes.append("predict only the answer tokens (target_ids: K outputs instead of C)")
        fixes.append("smaller batches")
        raise ValueError(
            f"the curvature needs about {fmt_bytes(self.total)} but {fmt_bytes(limit)} is "
            f"{'available' if max_memory is None else 'allowed (max_memory)'}:\n{self}\n"
            f"Refused before allocating. To fit: {'; '.join(fixes)}."
        )


def memory_estimate(
    model: nn.Module,
    subset: Subset,
    batch: Any,
    *,
    likelihood: str = "classification",
    fisher: str = "exact",
    mc_samples: int = 1,
    sharing: str = "reduce",
    dtype: torch.dtype = torch.float64,
    max_rank: int | None = None,
    oversample: int = 10,
    target_ids: Sequence[int] | Tensor | None = None,
    shift_labels: bool | None = None,
    logits: Tensor | None = None,
) -> MemoryEstimate:
    """Estimate the memory of a Kronecker Laplace fit and predictive before running it.

    Args:
        model: The network.
        subset: Kronecker-structured subset.
        batch: A typical (the largest) batch of the loader, any kind ``split_batch`` accepts.
        likelihood: ``"classification"`` or ``"regression"``.
        fisher: ``"exact"``, ``"mc"`` or ``"empirical"``.
        mc_samples: ``k`` of ``fisher="mc"``.
        sharing: ``"reduce"`` or ``"expand"``.
        dtype: Accumulation dtype of the factors.
        max_rank: Factor sides larger than this are kept at this rank (``None``: all whole).
        oversample: Extra sketch columns of a low-rank side.
        target_ids: The outputs the predictive covers (``None``: all ``C``).
        shift_labels: Causal-LM label shift (``None``: detected from the model's class).
        logits: The batch's logits if already computed; otherwise one forward pass without gradients is run.

    Returns:
        The `MemoryEstimate` (``print`` it; ``.check()`` refuses what does not fit).
    """
    kmods = subset.kron_modules()
    device = model_device(model)
    inputs, outputs = read_batch(
        batch, device, likelihood=likelihood, shift=resolve_shift_labels(model, shift_labels)
    )
    if logits is None:
        with torch.no_grad():
            logits = model_logits(model, inputs)
    keep = outputs.keep(logits[..., :0])
    b, n_cls = logits.shape[0], logits.shape[-1]
    n_kept = b if keep is None else int(keep.sum())
    mask = outputs.attention_mask
    t = logits.shape[1] if keep is not None else (1 if mask is None else mask.shape[1])
    rows = b if sharing == "reduce" else b * t
    item, mitem = torch.finfo(dtype).bits // 8, logits.element_size()
    passes = {"exact": n_cls, "mc": mc_samples}.get(fisher, 1)
    k_out = n_cls if target_ids is None else len(target_ids)
    factors = eigen = transient = 0
    largest, size = "", 0
    fit = (passes * n_kept * n_cls + 3 * b * t * n_cls) * mitem
    pred = n_kept * k_out * k_out * item
    for name, k in kmods.items():
        r, c = k.n_rows, k.n_cols + (k.bias_name is not None)
        for side, n in (("G", r), ("A", c)):
            if max_rank is not None and n > max_rank:
                q = min(n, max_rank + oversample)
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
        pred += k_out * b * t * r * mitem + b * t * c * mitem
    avail, source = available_memory(device)
    return MemoryEstimate(
        factors, eigen + transient, fit, pred, largest, fisher, k_out, avail, source
    )
