"""Kronecker factors: KFAC / S-KFAC (``G`` SUMMED, ``A`` AVERAGED) streamed, and the algebra of one block.

A factor side is whole, or beyond ``max_rank`` a streamed Nyström sketch; a block's precision has the eigenvalues
``E = λ_G λ_Aᵀ / T + δ`` in ``Q_G ⊗ Q_A``, whole or low-rank (rank ``r`` + isotropic rest).
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from partialbayes.curvature._hooks import (
    BatchObserver,
    Run,
    all_reduce,
    check_untied,
    entry_pass,
    fail_together,
    stream,
)
from partialbayes.curvature._likelihood import (
    OVERSAMPLE,
    CurvatureOptions,
    check_list,
    model_device,
)
from partialbayes.predictive.internal import check_finite
from partialbayes.selection import Subset
from partialbayes.selection.internal import KronModule, check_subset


@dataclass(frozen=True)
class LowRankFactor:
    """A PSD factor ``U diag(s) Uᵀ + rest · (I − U Uᵀ)``: ``U [n, r]`` orthonormal, ``s [r] ≥ 0``, 0-d ``rest``."""

    U: Tensor
    s: Tensor
    rest: Tensor

    @property
    def full(self) -> bool:
        """Whether the factor is kept whole (``r = n``)."""
        return self.U.shape[1] == self.U.shape[0]


def whole_factor(
    matrix: Tensor,
    dtype: torch.dtype | None = None,
    device: torch.device | None = None,
    what: str = "factor",
) -> LowRankFactor:
    """A PSD factor kept whole (``r = n``, no remainder): its eigenpairs, round-off below 0 clamped (shape checked)."""
    check_finite(matrix, f"{what} holds non-finite values (NaN or inf)")
    m = matrix.to(device=device, dtype=dtype)
    eigenvalues, eigenvectors = torch.linalg.eigh(0.5 * (m + m.T))
    eps = max(torch.finfo(matrix.dtype).eps, torch.finfo(m.dtype).eps)
    tol = max(eps**0.5, 10 * m.shape[0] * eps)
    scale = float(eigenvalues.abs().max()) if m.numel() else 0.0
    lowest = float(eigenvalues.min()) if m.numel() else 0.0
    if lowest < -tol * scale:
        raise ValueError(
            f"{what} is not positive semi-definite: its most negative eigenvalue is {lowest:.3g}, "
            f"{lowest / scale:.3g} times its largest in magnitude (round-off stays within {tol:.1e}); "
            "a curvature factor is a sum of outer products"
        )
    # row-major like a loaded posterior's tensors: matmuls then round identically before and after load
    s = eigenvalues.clamp(min=0.0)
    return LowRankFactor(eigenvectors.contiguous(), s, s.new_zeros(()))


def truncated(f: LowRankFactor, rank: int) -> LowRankFactor:
    """A whole factor's ``rank`` largest eigenpairs, the others as the remainder (their mean: trace kept)."""
    n = f.U.shape[0]
    if rank >= n:
        return f
    top = f.s.argsort(descending=True)[:rank]
    rest = ((f.s.sum() - f.s[top].sum()) / (n - rank)).clamp_min(0.0)
    return LowRankFactor(f.U[:, top].contiguous(), f.s[top], rest)


def precision_eigenvalues(
    g: LowRankFactor,
    a: LowRankFactor,
    prior_precision: Tensor | float,
    temperature: float = 1.0,
    curvature_scale: Tensor | float = 1.0,
) -> Tensor:
    """``E [r_G + 1, r_A + 1]``, ``E_ij = s λ_G,i λ_A,j / T + δ`` on the extended eigenvalues ``(s, rest)``.

    The eigenvalues of ``P`` in ``Q_G ⊗ Q_A``, the remainders last (``[:-1, :-1]`` for whole factors).
    """
    eig_g, eig_a = (torch.cat([f.s, f.rest.reshape(1)]) for f in (g, a))
    return torch.outer(eig_g, eig_a) * (curvature_scale / temperature) + prior_precision


def lowrank_log_det(eigenvalues: Tensor, g: LowRankFactor, a: LowRankFactor) -> Tensor:
    """``log det P`` from the extended eigenvalues ``E`` ``[r_G + 1, r_A + 1]`` and the multiplicities."""
    mg, ma = (
        f.s.new_ones(f.s.shape[0] + 1) for f in (g, a)
    )  # 1 per eigenpair, n − r the remainder
    mg[-1], ma[-1] = g.U.shape[0] - g.U.shape[1], a.U.shape[0] - a.U.shape[1]
    return (torch.outer(mg, ma) * eigenvalues.log()).sum()


def _scale_cols(y: Tensor, a: LowRankFactor, w: Tensor) -> Tensor:
    """``y`` ``[..., m, n_A]`` with its coordinates in ``[U_A, U_A⊥]`` multiplied by ``w`` ``[m | 1, r_A + 1]``."""
    v = a.U
    yv = y @ v
    out = (yv * w[..., :-1]) @ v.T
    if not a.full:
        out = out + (y - yv @ v.T) * w[..., -1:]
    return out


def scale_in_basis(z: Tensor, g: LowRankFactor, a: LowRankFactor, w: Tensor) -> Tensor:
    """Multiply ``z [..., n_G, n_A]``'s coordinates in the extended eigenbasis by ``w``."""
    u = g.U
    zc = u.T @ z  # [..., r_G, n_A]
    out = u @ _scale_cols(zc, a, w[:-1])
    if not g.full:
        out = out + _scale_cols(z - u @ zc, a, w[-1:])
    return out


def lowrank_covariance(
    x: Tensor,
    d: Tensor,
    g: LowRankFactor,
    a: LowRankFactor,
    inv_eigenvalues: Tensor,
    jacobians: bool | None = None,
) -> Tensor:
    """``J Σ Jᵀ`` ``[B, K, K]`` of one block with low-rank factors."""
    w = inv_eigenvalues
    k, _, t, n_g = d.shape
    if jacobians or (jacobians is None and n_g * x.shape[-1] <= (k * t) ** 2):
        jac = torch.einsum("kbti,btj->bkij", d, x)  # [B, K, n_G, n_A]
        return torch.einsum("bkij,blij->bkl", jac, scale_in_basis(jac, g, a, w))
    dc, xc = d @ g.U, x @ a.U  # [K, B, T, r_G], [B, T, r_A]
    m = torch.einsum("kbti,btj->bkij", dc, xc)
    cov = torch.einsum("bkij,blij->bkl", m * w[:-1, :-1], m)
    if not a.full:
        gram_x = x @ x.transpose(1, 2) - xc @ xc.transpose(1, 2)  # x⊥ x⊥ᵀ  [B, T, T]
        cov = cov + torch.einsum("kbti,lbsi,bts->bkl", dc * w[:-1, -1], dc, gram_x)
    if not g.full:
        gram_d = torch.einsum("kbti,lbsi->bktls", d, d) - torch.einsum("kbti,lbsi->bktls", dc, dc)
        wx = (xc * w[-1, :-1]) @ xc.transpose(1, 2)
        if not a.full:
            wx = wx + w[-1, -1] * gram_x
        cov = cov + torch.einsum("bktls,bts->bkl", gram_d, wx)
    return cov


@dataclass(frozen=True)
class ModuleFactors:
    """Kronecker factors ``G ⊗ A`` of one linear map (or its S-KFAC block) ``vec(W[R][:, C] | b[R])``, row-major.

    Attributes:
        module: Module name in the model.
        G: ``[r, r]``, ``r = |R|`` or ``n_out``: output-gradient factor, SUMMED over examples.
        A: ``[c, c]``, ``c = |C|`` or ``n_in``, ``+1`` when the bias is folded in (last index = the constant
            input 1): input factor, AVERAGED over examples (over unmasked tokens with ``sharing="expand"``).
        rows: Selected output indices ``R`` (``None`` = all).
        cols: Selected input indices ``C`` (``None`` = all).
        bias: ``True`` when the bias entries of ``R`` are in the block (folded into ``A``, or ``A_bias``).
        n_examples: Examples (sequences) the factors were computed from.
        A_bias: ``[1, 1]`` input factor of a bias kept separate (``bias="separate"``: the bias block is
            ``G ⊗ A_bias``, ``A`` covers the weight inputs only), else ``None``.
        sharing: The weight sharing the factors were computed with, ``"reduce"`` or ``"expand"``.

    ``G`` / ``A`` are low-rank (``LowRankFactor``) only inside ``KronLaplace(max_rank=...)``; `kfac` returns
    matrices. For HF ``Conv1D`` the orientation is the logical (n_out x n_in) one.
    """

    module: str
    G: Tensor | LowRankFactor
    A: Tensor | LowRankFactor
    rows: Tensor | None
    cols: Tensor | None
    bias: bool
    n_examples: int
    A_bias: Tensor | None = None
    sharing: str | None = None

    def input_factor(self) -> Tensor:
        """The whole block's input factor ``[c, c]`` (bias column last), ``A`` or ``blockdiag(A, A_bias)``.

        ``G ⊗ input_factor()`` is the block's curvature in ``vec(W[R][:, C] | b[R])`` order either way.
        """
        if self.A_bias is None:
            return self.A
        return torch.block_diag(self.A, self.A_bias.to(self.A))


def nystrom_factor(y: Tensor, omega: Tensor, trace: Tensor | float, rank: int) -> LowRankFactor:
    """The rank-``rank`` `LowRankFactor` from a sketch ``y = F Ω`` ``[n, q]``, ``omega`` and ``tr F``."""
    n = y.shape[0]
    info = torch.finfo(y.dtype)
    nu = (n**0.5 * info.eps * torch.linalg.matrix_norm(y, ord=2)).clamp_min(info.tiny)
    y_nu = y + nu * omega
    b = omega.T @ y_nu
    chol = torch.linalg.cholesky(0.5 * (b + b.T))
    e = torch.linalg.solve_triangular(chol, y_nu.T, upper=False).T  # Y_ν L⁻ᵀ: F̂ = E Eᵀ
    u, sv, _ = torch.linalg.svd(e, full_matrices=False)
    s = (sv[:rank] ** 2 - nu).clamp_min(0.0)
    rest = (torch.as_tensor(trace, dtype=y.dtype, device=y.device) - s.sum()).clamp_min(0.0)
    return LowRankFactor(u[:, :rank].contiguous(), s, rest / max(n - rank, 1))


class FactorAccumulator:
    """One block's running ``Σ δδᵀ``, ``Σ x̃x̃ᵀ`` and input row count.

    A side of size ``n`` above ``max_rank`` is a streamed Nyström sketch ``Y = F Ω`` ``[n, q]`` with ``tr F``
    (Tropp et al. 2017; ``Ω`` orthonormal, drawn on the CPU from seed 0), never ``n × n``.
    """

    def __init__(
        self,
        r: int,
        c: int,
        dtype: torch.dtype,
        device: torch.device,
        max_rank: int | None = None,
        bias: bool = False,
    ) -> None:
        self.sizes = (r, c + bias)
        self.ranks = [n if max_rank is None else min(max_rank, n) for n in self.sizes]
        self.omegas: list[Tensor | None] = [None, None]  # None: the side is kept whole, Y = F
        for i, (n, k) in enumerate(zip(self.sizes, self.ranks, strict=True)):
            if k < n:
                g = torch.Generator().manual_seed(0)
                sketch = torch.randn(n, min(n, k + OVERSAMPLE), generator=g, dtype=dtype)
                self.omegas[i] = torch.linalg.qr(sketch.to(device)).Q
        self.sums: list[Tensor | None] = [None, None]  # allocated by the first rows
        self.traces = torch.zeros(2, dtype=dtype, device=device)
        self.count = torch.zeros((), dtype=dtype, device=device)
        self.bias = bias  # add() then needs ``w``

    def add(self, x: Tensor, count: Tensor | float, d: Tensor, w: Tensor | None = None) -> None:
        """Add input rows ``x [m, c]`` (weights ``w [m, 1]``) counting ``count``, gradient rows ``δ [m', r]``."""
        for i, rows in enumerate((d, x if w is None else torch.cat([x, w.to(x)], dim=1))):
            rows, omega, y = rows.to(self.count.dtype), self.omegas[i], self.sums[i]
            if omega is not None:
                self.traces[i] += rows.square().sum()
            right = rows if omega is None else rows @ omega
            self.sums[i] = rows.T @ right if y is None else y.addmm_(rows.T, right)
        self.count += count

    def result(self, m: str, k: KronModule, n_examples: int, sharing: str | None) -> ModuleFactors:
        """Module ``m``'s factors reduced over ranks (``G`` summed, ``A`` averaged); refuses an overflow."""
        sums = [  # zeros: no rows on this rank
            self.count.new_zeros(n, n if o is None else o.shape[1]) if y is None else y
            for y, n, o in zip(self.sums, self.sizes, self.omegas, strict=True)
        ]
        for t in [*sums, self.traces, self.count]:
            all_reduce(t)
        scales = (1.0, 1 / float(self.count.clamp_min(1)))  # G summed, A averaged
        G, A = (
            y * s if o is None else nystrom_factor(y * s, o, tr * s, rank)
            for y, o, tr, rank, s in zip(
                sums, self.omegas, self.traces, self.ranks, scales, strict=True
            )
        )
        parts = [
            p for f in (G, A) for p in ((f.U, f.s, f.rest) if isinstance(f, LowRankFactor) else [f])
        ]
        if not all(bool(torch.isfinite(p).all()) for p in parts):
            raise ValueError(f"non-finite curvature in module {m!r} (overflow in the factor sums)")
        # a separate bias's input factor: the average of the constant input 1, [1] once a row counted
        has_bias = k.bias_name is not None
        separate = has_bias and not self.bias  # a bias in the block, not folded into A
        A_bias = (self.count / self.count.clamp_min(1)).reshape(1, 1) if separate else None
        return ModuleFactors(m, G, A, k.rows, k.cols, has_bias, n_examples, A_bias, sharing)


@dataclass(frozen=True)
class KronTargets:
    """A Kronecker subset's maps resolved against a model: hooked ``modules``, ``cols`` / ``rows``."""

    kmods: dict[str, KronModule]
    modules: dict[str, nn.Module]
    cols: dict[str, Tensor | None]
    rows: dict[str, Tensor | None]


def shared_rows(t: Tensor, mask: Tensor | None, sharing: str, *, mean: bool) -> Tensor:
    """The rows ``[m, d]`` of ``t`` under ``mask``: per sequence (summed, or ``mean``) or per token."""
    if mask is None:
        return t
    if sharing == "expand":
        return (t * mask[..., None]).reshape(-1, t.shape[-1])
    s = torch.einsum("btd,bt->bd", t, mask)
    return s / mask.sum(1, keepdim=True) if mean else s


def kron_targets(model: nn.Module, subset: Subset, what: str) -> KronTargets:
    """``subset.kron_modules()`` checked against ``model`` (present, untied) and resolved for the hooks."""
    check_subset(subset, empty_ok=False)
    try:
        kmods = subset.kron_modules()
    except TypeError as err:
        raise TypeError(
            f"{what} needs a Kronecker-structured subset (KronBlock blocks): {err}. "
            "For elementwise mask subsets use diag_curvature or dense_curvature "
            "(DiagLaplace / DenseLaplace)."
        ) from err
    named = dict(model.named_modules())
    missing = [m for m in kmods if m not in named]
    if missing:
        raise ValueError(f"modules {missing} of the subset are not in the model")
    modules = {m: named[m] for m in kmods}
    check_untied(model, modules)
    device = model_device(model)
    return KronTargets(
        kmods=kmods,
        modules=modules,
        cols={m: None if k.cols is None else k.cols.to(device) for m, k in kmods.items()},
        rows={m: None if k.rows is None else k.rows.to(device) for m, k in kmods.items()},
    )


def carries_gradient(energy: Tensor, eps: float) -> Tensor:
    """``[B, T]`` positions whose largest ``‖δ_t‖²`` exceeds ``eps · max`` (zero up to rounding: attention kernels)."""
    return energy > eps * energy.max()


def kfac(
    model: nn.Module,
    loader: Iterable[Any],
    subset: Subset,
    *,
    likelihood: str = "classification",
    fisher: str = "exact",
    mc_samples: int = 1,
    sharing: str | None = None,
    bias: str = "fold",
    sigma_noise: float = 1.0,
    dtype: torch.dtype = torch.float64,
    generator: torch.Generator | None = None,
    progress: bool = False,
    num_classes: int | None = None,
    on_batch: BatchObserver | None = None,
    shift_labels: bool | None = None,
) -> dict[str, ModuleFactors]:
    r"""KFAC (or Sparse-KFAC) factors of every linear map of a Kronecker-structured subset.

    For each module the summed curvature of its selected block ``vec(W[R][:, C] | b[R])`` (row-major) is
    approximated by ``G ⊗ A`` with

    $$ G = \sum_n \sum_s \delta_{n,s}[R]\,\delta_{n,s}[R]^\top, \qquad
       A = \frac{1}{N} \sum_n \tilde x_n[C]\,\tilde x_n[C]^\top, $$

    ``G`` SUMMED and ``A`` AVERAGED (the laplace-torch convention), ``x̃ = (x, 1)`` with a folded bias. S-KFAC
    blocks gather ``δ[:, R]`` and ``x[:, C]`` in the hooks: the full factors are never formed.

    Token sequences: ``sharing="reduce"`` sums ``δ`` and averages ``x`` over each sequence's unmasked
    tokens, ``"expand"`` makes every unmasked token an example; a module called several times per forward
    pass has its calls merged as extra positions. Token-level logits ``[B, T, C]`` count one output per kept
    position (attention mask 1, label not -100) and take ``"expand"``; a module's examples are then its
    positions whose ``δ`` is not zero up to rounding. Label -100 skips an output for ``[B, C]`` logits too;
    a batch left without a labelled output is skipped with one warning. The curvature concept page derives
    each case and its exactness.

    Args:
        model: Network returning logits ``[B, C]`` or ``[B, T, C]`` (or an output with ``.logits``), run in
            eval mode (a training-mode model is switched with a warning and restored).
        loader: Batches: tensors, pairs ``(inputs, labels)``, or mappings (``dict``, ``BatchEncoding``) with
            ``"labels"`` / ``"label"`` and an ``"attention_mask"``.
        subset: Kronecker-structured :class:`~partialbayes.selection.Subset` (several in one pass: `kfac_many`). A
            list of them (the 0.4.0 API) is deprecated: it warns (``FutureWarning``) and returns `kfac_many`'s list.
        likelihood: ``"classification"`` (softmax cross-entropy) or ``"regression"`` (Gaussian).
        fisher: ``"exact"`` (GGN, one backward pass per class), ``"mc"`` (``mc_samples`` sampled labels) or
            ``"empirical"`` (true labels).
        mc_samples: Number of sampled labels per example for ``fisher="mc"``.
        sharing: ``"reduce"`` or ``"expand"`` weight sharing over tokens; ``None`` (default): ``"expand"``
            for token-level logits ``[B, T, C]``, ``"reduce"`` for one output per example. Recorded in
            ``ModuleFactors.sharing``.
        bias: ``"fold"`` (bias as the last column of ``A``) or ``"separate"`` (own block ``G ⊗ A_bias``).
        sigma_noise: Gaussian noise standard deviation (regression).
        dtype: Accumulation dtype of the factors (float32 or float64).
        generator: Random generator for ``fisher="mc"``.
        progress: Show a tqdm progress bar.
        num_classes: When given, the number of logits the model must output.
        on_batch: ``on_batch(index, logits, labels)`` after each batch's forward pass, with the detached
            output rows ``[N, C]`` and their checked labels (or ``None``): e.g. the training loss.
        shift_labels: Causal-LM outputs: the output at ``t`` is scored against ``labels[t + 1]``.
            ``None`` (default): whether the model's class name ends with ``ForCausalLM`` / ``LMHeadModel``.

    Returns:
        ``{module name: ModuleFactors}`` in the subset's model order.
        Under ``torch.distributed`` the sums are reduced across ranks (the factors of the union of shards).

    Raises:
        TypeError: A subset with elementwise mask blocks (use :func:`diag_curvature` /
            :func:`dense_curvature`), or a batch of unknown kind.
        ValueError: Bad options, empty loader or batch, bad labels (whenever a batch has them) or logits,
            an example without unmasked tokens, token-level logits with ``sharing="reduce"`` or without an
            attention mask or labels, non-finite curvature (naming the module and batch), a loader without
            any labelled output.
        RuntimeError: Under ``torch.distributed``, on every rank whose shard went through when another
            rank raised (all ranks fail instead of waiting for each other).
    """
    args = dict(locals())  # the arguments, for entry_pass
    if isinstance(subset, (list, tuple)):  # the 0.4.0 API
        warnings.warn(
            "kfac(model, loader, [subsets], ...) is deprecated and will be removed: call "
            "kfac_many(model, loader, subsets, ...) with the same options",
            FutureWarning,
            stacklevel=2,
        )
        subsets = check_list(subset, "subset", Subset)
        return entry_pass(kron_factors, args, [kron_targets(model, s, "kfac") for s in subsets])
    return entry_pass(kron_factors, args, [kron_targets(model, subset, "kfac")])[0]


def kfac_many(
    model: nn.Module, loader: Iterable[Any], subsets: Sequence[Subset], **options: Any
) -> list[dict[str, ModuleFactors]]:
    """`kfac` of several subsets (a ramp) in one pass, each bit-identical to `kfac` on it alone.

    ``subsets`` is a non-empty list of Kronecker-structured subsets; ``model``, ``loader`` and the keyword
    ``options`` are `kfac`'s. ``fisher="mc"`` draws the labels once per batch for every subset. A block (map,
    rows, columns) that several subsets hold is accumulated once: their factors are the same `ModuleFactors`
    object. Memory: the factor sums of every distinct block.

    Returns:
        One ``{module name: ModuleFactors}`` per subset, in order.

    Raises:
        TypeError, ValueError, RuntimeError: As `kfac`; a bad list (naming the culprit) or option.
    """
    args = inspect.signature(kfac).bind(model, loader, subsets, **options)  # kfac's options only
    args.apply_defaults()
    targets = [kron_targets(model, s, "kfac") for s in check_list(subsets, "subsets", Subset)]
    return entry_pass(kron_factors, args.arguments, targets)


def block_key(m: str, k: KronModule) -> tuple[Any, ...]:
    """Map ``m``'s block ``k``: subsets asking for the same map, rows, columns and bias share it."""
    r, c = (None if i is None else tuple(i.tolist()) for i in (k.rows, k.cols))
    return m, r, c, k.bias_name is not None


def kron_factors(
    model: nn.Module,
    loader: Iterable[Any],
    targets: Sequence[KronTargets],
    options: CurvatureOptions,
    run: Run,
) -> list[dict[str, ModuleFactors]]:
    """`kfac`'s pass: each map's ``x`` and ``δ`` recorded once, each distinct block accumulated once.

    Subsets with the same block (map, rows, columns) get the same `ModuleFactors` object.
    """
    modules = {m: mod for t in targets for m, mod in t.modules.items()}
    device = model_device(model)
    keys = [{m: block_key(m, k) for m, k in t.kmods.items()} for t in targets]
    blocks = {key: (t, m) for t, ks in zip(targets, keys, strict=True) for m, key in ks.items()}
    accs = {
        key: FactorAccumulator(
            t.kmods[m].n_rows,
            t.kmods[m].n_cols,
            options.dtype,
            device,
            options.max_rank,
            bias=t.kmods[m].bias_name is not None and options.bias == "fold",
        )
        for key, (t, m) in blocks.items()
    }
    n_examples = 0
    sharing = options.sharing
    with fail_together(device):
        for bp in stream(model, loader, modules, options, run):
            token_level = bp.keep is not None
            if sharing is None:
                sharing = "expand" if token_level else "reduce"
            if token_level and sharing == "reduce":
                raise ValueError(
                    f"batch {bp.index}: the model returns token-level logits (one output per kept "
                    "position), which is KFAC's 'expand' setting; sharing='reduce' sums the output "
                    "gradients over a sequence before the outer product and so assumes one loss per "
                    "sequence. Pass sharing='expand' (or leave sharing=None)"
                )
            n_examples += bp.n_examples
            deltas: dict[Any, list[Tensor]] = {key: [] for key in blocks}
            energy: dict[str, Tensor] = {}  # token-level: the largest ‖δ_t‖² over the passes
            for grads in bp.passes:
                for m, d in grads.items():
                    tm = bp.token_masks[m]
                    if token_level and tm is not None:
                        e = d.square().sum(-1)  # full rows, before an S-KFAC gather
                        energy[m] = torch.maximum(energy[m], e) if m in energy else e
                    for key, (t, bm) in blocks.items():
                        if bm == m:
                            r = t.rows[m]
                            dr = d if r is None else d.index_select(-1, r)
                            deltas[key].append(shared_rows(dr, tm, sharing, mean=False))
            masks = dict(bp.token_masks)
            for m, tm in masks.items():
                if m in energy and tm is not None:  # G is unchanged: δ ≈ 0 where this drops
                    eps = torch.finfo(energy[m].dtype).eps
                    masks[m] = tm = tm * carries_gradient(energy[m], eps).to(tm.dtype)
                if tm is not None and sharing == "reduce" and bool((tm.sum(1) == 0).any()):
                    raise ValueError(f"batch {bp.index}: an example has no unmasked token")
            checks: list[tuple[str, Tensor]] = []
            for key, (t, m) in blocks.items():
                x, c, tm, acc = bp.inputs[m], t.cols[m], masks[m], accs[key]
                if c is not None:
                    x = x.index_select(-1, c)
                xr = shared_rows(x, tm, sharing, mean=True)
                dd = deltas[key][0] if len(deltas[key]) == 1 else torch.cat(deltas[key])
                ones = torch.ones_like(x[..., :1])  # the folded bias's input column
                w = shared_rows(ones, tm, sharing, mean=True) if acc.bias else None
                n = x.shape[0] if tm is None or sharing == "reduce" else tm.sum()  # rows A averages
                acc.add(xr, n, dd, w)
                checks.append((m, xr.sum() + dd.sum()))
            # finite rows give finite factors (overflow is caught on the totals below)
            if not bool(torch.isfinite(torch.stack([v for _, v in checks]).sum())):
                bad = next(m for m, v in checks if not v.isfinite())
                raise ValueError(f"non-finite curvature in module {bad!r} at batch {bp.index}")
    n_examples = round(float(all_reduce(torch.tensor(float(n_examples), device=device))))
    done = {
        key: accs[key].result(m, t.kmods[m], n_examples, sharing) for key, (t, m) in blocks.items()
    }
    return [{m: done[key] for m, key in ks.items()} for ks in keys]
