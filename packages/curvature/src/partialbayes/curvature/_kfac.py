"""KFAC and Sparse-KFAC factors of the linear maps of a Kronecker-structured subset."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor, nn

from partialbayes.curvature._distributed import all_reduce_int, fail_together
from partialbayes.curvature._factors import FactorAccumulator, ModuleFactors
from partialbayes.curvature._hooks import BatchObserver, prepared, stream
from partialbayes.curvature._kfac_math import row_count, shared_rows
from partialbayes.curvature._likelihood import check_options, model_device
from partialbayes.curvature._outputs import resolve_shift_labels
from partialbayes.selection import KronModule, Subset


def kron_targets(model: nn.Module, subset: Subset, what: str) -> dict[str, KronModule]:
    """``subset.kron_modules()`` checked against ``model``; a mask subset raises a TypeError with a pointer.

    Raises:
        TypeError: If ``subset`` is not a Subset or has elementwise mask blocks.
        ValueError: If a module of the subset is not in ``model``.
    """
    if not isinstance(subset, Subset):
        raise TypeError(
            f"subset must be a partialbayes.selection.Subset, got {type(subset).__name__}"
        )
    try:
        kmods = subset.kron_modules()
    except TypeError as err:
        raise TypeError(
            f"{what} needs a Kronecker-structured subset (KronBlock blocks): {err}. "
            "For elementwise mask subsets use diag_curvature or dense_curvature "
            "(DiagLaplace / DenseLaplace)."
        ) from err
    if not kmods:
        raise ValueError("subset is empty: no linear map to compute factors for")
    named = dict(model.named_modules())
    missing = [m for m in kmods if m not in named]
    if missing:
        raise ValueError(f"modules {missing} of the subset are not in the model")
    return kmods


def carries_gradient(energy: Tensor, eps: float) -> Tensor:
    """``[B, T]`` bool: the positions whose output gradient ``δ`` is not zero, up to rounding.

    A position whose ``δ`` is zero in every backward pass (it feeds no kept output) does not count, nor one
    whose ``δ`` is rounding noise: attention kernels leave gradients of order ``1e-22`` where the exact value
    is zero (the query of a token with a single unmasked key). The test is ``‖δ_t‖² > eps · max_u ‖δ_u‖²``
    over the batch's positions ``u``: a dropped position's ``δ_t δ_tᵀ`` is below the rounding level of the
    largest term of ``G``'s sum.

    Args:
        energy: ``[B, T]`` the largest ``‖δ_t‖²`` of each position over the backward passes.
        eps: The machine epsilon of ``δ``'s dtype.
    """
    return energy > eps * energy.max()


def kfac(
    model: nn.Module,
    loader: Iterable[Any],
    subset: Subset,
    *,
    likelihood: str = "classification",
    fisher: str = "exact",
    mc_samples: int = 1,
    sharing: str = "reduce",
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

    ``G`` SUMMED and ``A`` AVERAGED (the laplace-torch convention), ``x̃ = (x, 1)`` when the bias is in the
    subset and ``bias="fold"``. With ``bias="separate"`` the weight block is ``G ⊗ A`` with ``x̃ = x[C]``
    and the bias block is ``G ⊗ A_bias`` (``ModuleFactors.A_bias = [1]``: the bias's input is the constant
    1, its output-gradient factor the same ``G``); the weight–bias cross terms are dropped. S-KFAC blocks
    gather ``δ[:, R]`` and ``x[:, C]`` in the hooks: the full factors are never formed.
    Token sequences (``[B, T, d]`` activations): ``sharing="reduce"`` sums ``δ`` and averages ``x`` over the
    unmasked tokens of each sequence before the outer products (exact for deep linear networks with one
    loss per sequence); ``"expand"`` treats every unmasked token as an example (``A`` averaged over tokens).
    Padding tokens (``attention_mask == 0``) never contribute. A module called several times per forward
    pass (a shared, tied or looped layer) contributes every call, the calls merged as extra token positions
    of each example (its per-example gradient is ``Σ_calls Σ_t δ_t x_tᵀ``): ``reduce`` sums ``δ`` and
    averages ``x`` over all calls' positions (exact with one datum when the calls' output gradients agree,
    e.g. their outputs are summed; for any data in deep linear networks with MSE), ``expand`` treats each
    call's positions as examples (exact for deep linear networks with MSE when each call feeds its own
    outputs through the same linear path).

    Token-level outputs (logits ``[B, T, C]``: token classification, causal language models) count one
    output per kept position — positions where the attention mask is 0 or the label is -100 are dropped —
    and need ``sharing="expand"`` (``"reduce"`` assumes one loss per sequence and is refused). The ``S``
    backward passes carry every kept position's output vector at once (as curvlinops does). Each module's
    examples are its real positions (attention mask 1) whose output gradient ``δ`` is not zero in some
    pass (above rounding level, see `carries_gradient`): ``G`` sums ``δδᵀ`` and ``A`` averages ``x̃x̃ᵀ``
    over them. A position whose own output is not kept
    still counts where it feeds a kept one — a prompt token labelled -100, seen through attention by the
    answer — and a position that feeds none (the output layer away from the kept positions, tokens after
    the last kept output of a causal model) does not. So the factors are exact in KFAC-expand's exact cases
    (positions that do not interact, e.g. deep linear per-token networks, or one kept position) and
    otherwise also hold cross-position terms, like any KFAC of a transformer. Causal LMs shift their labels
    (the output at ``t`` predicts token ``t + 1``): see ``shift_labels``.

    Args:
        model: Network; its forward takes a tensor or keyword inputs and returns logits ``[B, C]`` or
            ``[B, T, C]`` (or an output with ``.logits``). Run in eval mode (a training-mode model is
            switched with a warning and restored).
        loader: Iterable of batches: tensors, pairs ``(inputs, labels)``, or mappings (``dict``, the
            ``BatchEncoding`` of ``DataCollatorWithPadding``) with ``"labels"`` / ``"label"`` and an
            ``"attention_mask"``.
        subset: Kronecker-structured :class:`~partialbayes.selection.Subset`.
        likelihood: ``"classification"`` (softmax cross-entropy) or ``"regression"`` (Gaussian).
        fisher: ``"exact"`` (GGN, one backward pass per class), ``"mc"`` (``mc_samples`` sampled labels) or
            ``"empirical"`` (true labels).
        mc_samples: Number of sampled labels per example for ``fisher="mc"``.
        sharing: ``"reduce"`` or ``"expand"`` weight sharing over tokens.
        bias: ``"fold"`` (bias as the last column of ``A``) or ``"separate"`` (own block ``G ⊗ A_bias``).
        sigma_noise: Gaussian noise standard deviation (regression).
        dtype: Accumulation dtype of the factors (float32 or float64).
        generator: Random generator for ``fisher="mc"``.
        progress: Show a tqdm progress bar.
        num_classes: When given, the number of logits the model must output.
        on_batch: Called as ``on_batch(index, logits, labels)`` after each batch's forward pass, with the
            detached output rows ``[N, C]`` (``[B, C]`` logits, or the kept positions of token-level ones)
            and their validated labels (``None`` for a batch without labels); e.g. to accumulate the
            training loss in the same pass (``LaplaceBase.fit`` does). The loader is read once.
        shift_labels: Token-level outputs of a causal LM: the output at ``t`` is scored against
            ``labels[t + 1]`` and kept when tokens ``t`` and ``t + 1`` are real and that label is not
            -100. ``None`` (default): ``True`` exactly when the model's class name ends with
            ``ForCausalLM`` or ``LMHeadModel``.

    Returns:
        ``{module name: ModuleFactors}`` in the subset's model order. Under ``torch.distributed`` the sums
        are reduced across ranks, giving the factors of the union of the shards.

    Raises:
        TypeError: A subset with elementwise mask blocks (use :func:`diag_curvature` /
            :func:`dense_curvature`), or a batch of unknown kind.
        ValueError: Bad options, empty loader, labels (whenever a batch has them, whatever the fisher)
            of the wrong dtype, shape or out of range, logits of the wrong shape, an example without
            unmasked tokens, token-level logits with ``sharing="reduce"`` or without an attention mask or
            labels, non-finite curvature (naming the module and batch).
        RuntimeError: Under ``torch.distributed``, on every rank whose shard went through when another
            rank raised (all ranks fail instead of waiting for each other).
    """
    check_options(
        likelihood,
        fisher,
        mc_samples,
        sigma_noise,
        sharing,
        dtype=dtype,
        generator=generator,
        num_classes=num_classes,
    )
    if bias not in ("fold", "separate"):
        raise ValueError(f"bias must be 'fold' or 'separate', got {bias!r}")
    return kron_factors(
        model,
        loader,
        kron_targets(model, subset, "kfac"),
        sharing=sharing,
        bias=bias,
        dtype=dtype,
        likelihood=likelihood,
        fisher=fisher,
        mc_samples=mc_samples,
        sigma_noise=sigma_noise,
        generator=generator,
        num_classes=num_classes,
        shift_labels=resolve_shift_labels(model, shift_labels),
        progress=progress,
        on_batch=on_batch,
    )


def hook_targets(
    model: nn.Module, kmods: dict[str, KronModule]
) -> tuple[dict[str, nn.Module], dict[str, Tensor | None], dict[str, Tensor | None]]:
    """What the hooks need for Kronecker modules: ``(modules, cols, rows)``, the indices on the model's device.

    ``cols`` gather the inputs ``x[:, C]`` (``None``: all), ``rows`` the output gradients ``δ[:, R]``.
    """
    named = dict(model.named_modules())
    device = model_device(model)
    modules = {m: named[m] for m in kmods}
    cols = {m: None if k.cols is None else k.cols.to(device) for m, k in kmods.items()}
    rows = {m: None if k.rows is None else k.rows.to(device) for m, k in kmods.items()}
    return modules, cols, rows


def kron_factors(
    model: nn.Module,
    loader: Iterable[Any],
    kmods: dict[str, KronModule],
    *,
    sharing: str,
    bias: str,
    dtype: torch.dtype,
    **options: Any,
) -> dict[str, ModuleFactors]:
    """`kfac`'s pass over ``loader`` for Kronecker modules already resolved and options already checked.

    Args:
        model: The network.
        loader: Batches (read once).
        kmods: ``subset.kron_modules()`` (see `kron_targets`).
        sharing: ``"reduce"`` or ``"expand"``.
        bias: ``"fold"`` or ``"separate"``.
        dtype: Accumulation dtype.
        **options: `stream`'s keywords (likelihood, fisher, mc_samples, sigma_noise, generator,
            num_classes, shift_labels as a bool, progress, on_batch).

    Returns:
        ``{module name: ModuleFactors}`` (see `kfac`).
    """
    modules, cols, rows = hook_targets(model, kmods)
    device = model_device(model)
    acc = {m: FactorAccumulator(k.n_rows, k.n_cols, dtype, device) for m, k in kmods.items()}
    n_examples = 0
    with fail_together(device), prepared(model, modules):
        for bp in stream(model, loader, modules, cols, positions="joint", **options):
            if bp.keep is not None and sharing == "reduce":
                raise ValueError(
                    f"batch {bp.index}: the model returns token-level logits (one output per kept "
                    "position), which is KFAC's 'expand' setting; sharing='reduce' sums the output "
                    "gradients over a sequence before the outer product and so assumes one loss per "
                    "sequence. Pass sharing='expand'"
                )
            n_examples += bp.n_examples
            token_level = bp.keep is not None
            deltas: dict[str, list[Tensor]] = {m: [] for m in kmods}
            energy: dict[str, Tensor] = {}  # token-level: the largest ‖δ_t‖² over the passes
            eps: dict[str, float] = {}
            for grads in bp.passes:
                for m, d in grads.items():
                    tm = bp.token_masks[m]
                    if token_level and tm is not None:
                        e = d.square().sum(-1)  # full rows, before an S-KFAC gather
                        energy[m] = torch.maximum(energy[m], e) if m in energy else e
                        eps[m] = torch.finfo(d.dtype).eps
                    r = rows[m]
                    if r is not None:
                        d = d.index_select(-1, r)
                    deltas[m].append(shared_rows(d, tm, sharing, mean=False))
            checks: dict[str, Tensor] = {}
            for m, x in bp.inputs.items():
                tm = bp.token_masks[m]
                if m in energy and tm is not None:  # G is unchanged: δ ≈ 0 where this drops
                    tm = tm * carries_gradient(energy[m], eps[m]).to(tm.dtype)
                if tm is not None and sharing == "reduce" and bool((tm.sum(1) == 0).any()):
                    raise ValueError(f"batch {bp.index}: an example has no unmasked token")
                xr = shared_rows(x, tm, sharing, mean=True)
                acc[m].add_inputs(xr, row_count(x, tm, sharing))
                checks[m] = xr.sum()
            for m, ds in deltas.items():
                dd = torch.cat(ds) if len(ds) > 1 else ds[0]
                acc[m].add_grads(dd)
                checks[m] = checks[m] + dd.sum()
            # finite rows give finite factors (overflow is caught on the totals below)
            total = torch.stack(list(checks.values())).sum()
            if not bool(torch.isfinite(total)):
                bad = next(m for m, v in checks.items() if not bool(torch.isfinite(v)))
                raise ValueError(f"non-finite curvature in module {bad!r} at batch {bp.index}")
    n_examples = all_reduce_int(n_examples, device)
    out: dict[str, ModuleFactors] = {}
    for m, k in kmods.items():
        acc[m].all_reduce()
        has_bias = k.bias_name is not None
        separate = has_bias and bias == "separate"
        A_bias = acc[m].bias_factor() if separate else None
        G, A = acc[m].factors(bias=has_bias and not separate)
        if not bool(torch.isfinite(G).all() and torch.isfinite(A).all()):
            raise ValueError(
                f"non-finite curvature in module {m!r} (overflow in the accumulated factors)"
            )
        out[m] = ModuleFactors(
            module=m,
            G=G,
            A=A,
            rows=k.rows,
            cols=k.cols,
            bias=has_bias,
            n_examples=n_examples,
            A_bias=A_bias,
        )
    return out
