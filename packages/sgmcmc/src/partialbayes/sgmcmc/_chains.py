"""Running chains: one serial chain with burn-in and thinning, or parallel chains (a Bayesian deep ensemble)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from partialbayes.predictive.internal import (
    IGNORE_INDEX,
    check_int,
    check_labels,
    flatten_outputs,
    gradients_only,
    model_logits,
    split_batch,
)
from partialbayes.selection import Subset
from partialbayes.sgmcmc._posterior import SampledPosterior
from partialbayes.sgmcmc._sampler import SGMCMC

LossFn = Callable[[nn.Module, Any], Tensor]
Data = Iterable[Any] | Callable[[int], Iterable[Any]]


def classification_loss(model: nn.Module, batch: Any) -> Tensor:
    """Mean cross-entropy over the labelled outputs of a batch (label -100 skipped; no causal-LM shift).

    For a causal LM pass ``loss_fn=lambda m, b: m(**b).loss`` (Hugging Face shifts the labels itself).
    """
    b = split_batch(batch, device=next(model.parameters()).device)
    if b.labels is None:
        raise ValueError("classification_loss needs labelled batches")
    logits, labels = flatten_outputs(
        model_logits(model, b.inputs), b.labels, attention_mask=b.attention_mask
    )
    kept = labels[
        labels != IGNORE_INDEX
    ]  # before torch's bare IndexError (CPU) or device assert (CUDA)
    check_labels(f"labels (other than {IGNORE_INDEX})", kept, kept.numel(), logits.shape[-1])
    return F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX)


def _cycle(data: Iterable[Any]) -> Iterator[Any]:
    while True:
        n = -1
        for n, batch in enumerate(data):  # noqa: B007
            yield batch
        if n < 0:
            raise ValueError("data yielded no batch")


def run_chain(
    model: nn.Module,
    subset: Subset,
    data: Iterable[Any],
    *,
    n_steps: int,
    loss_fn: LossFn = classification_loss,
    seed: int = 0,
    progress: Callable[[int, float], None] | None = None,
    **sampler_options: Any,
) -> SGMCMC:
    """Run one chain of `SGMCMC` for ``n_steps`` steps from the model's current weights; restore them after.

    Each step: ``loss_fn(model, batch).backward()`` (the **mean** batch loss) and ``sampler.step()``, with
    ``data`` re-iterated when exhausted. The kept samples are in ``sampler.samples`` (``sampler.posterior()``).

    Args:
        model: The model (its mode is kept: call ``model.eval()`` first to sample without dropout).
        subset: The entries to sample.
        data: Batches of any kind ``loss_fn`` reads.
        n_steps: Number of steps.
        loss_fn: ``(model, batch) -> mean loss`` (default: the mean cross-entropy over the labelled outputs, label -100 skipped).
        seed: Seed of the chain's noise (a generator on the model's device).
        progress: Called as ``progress(step, loss)`` after each step.
        **sampler_options: Keywords of `SGMCMC` (``lr``, ``num_data``, ``method``, ``temperature``, …).

    Raises:
        ValueError: A non-finite loss (naming the step), empty data, or a bad sampler setting.
    """
    check_int("n_steps", n_steps)
    params = subset.parameters_of(model)
    device = next(iter(params.values())).device
    generator = torch.Generator(device=device).manual_seed(seed)
    start = {n: subset.gather(n, p.detach()).clone() for n, p in params.items()}
    # the model gets its weights back, whatever happens; gradients only for the subset's tensors
    with subset.swapped(model, start), gradients_only(model, subset.names):
        sampler = SGMCMC(model, subset, generator=generator, **sampler_options)
        batches = _cycle(data)
        for step in range(1, n_steps + 1):
            model.zero_grad(set_to_none=True)
            loss = loss_fn(model, next(batches))
            if not bool(torch.isfinite(loss)):
                raise ValueError(f"non-finite loss {float(loss.detach())} at chain step {step}")
            loss.backward()
            sampler.step()
            if progress is not None:
                progress(step, float(loss.detach()))
        model.zero_grad(set_to_none=True)
    return sampler


def parallel_chains(
    model: nn.Module,
    subset: Subset,
    data: Data,
    *,
    n_chains: int,
    n_steps: int,
    seed: int = 0,
    likelihood: str = "classification",
    sigma_noise: float = 1.0,
    **chain_options: Any,
) -> SampledPosterior:
    """Parallel SGMCMC: ``n_chains`` independent chains from the model's weights, the last state of each.

    Chain ``c`` uses noise seed ``seed + c`` and the batches of ``data(c)`` (if callable) or ``data``. At
    ``temperature=0`` this is a deep ensemble of the subset; at ``T = 1`` each member tends to an exact
    posterior draw (Duffield et al., 2024, Sec. 4.2). Chains run one after the other (`SampledPosterior.concat`
    joins groups run elsewhere).

    Args:
        model: The model (left with its weights).
        subset: The entries to sample.
        data: Batches, or ``chain index -> batches``.
        n_chains: Number of chains ``S`` (the posterior's samples).
        n_steps: Steps per chain.
        seed: Seed of chain 0.
        likelihood: Of the returned posterior (``"classification"`` / ``"regression"``).
        sigma_noise: Observation noise of a regression posterior.
        **chain_options: Keywords of `run_chain` and `SGMCMC` (not ``burn_in`` / ``thin``: only the last
            state is kept).
    """
    check_int("n_chains", n_chains)
    check_int("n_steps", n_steps)
    chain_options.update(burn_in=n_steps - 1, thin=1)
    last = [
        run_chain(
            model,
            subset,
            data(c) if callable(data) else data,
            n_steps=n_steps,
            seed=seed + c,
            **chain_options,
        ).samples[-1]
        for c in range(n_chains)
    ]
    samples = {n: torch.stack([s[n] for s in last]) for n in subset.names}
    return SampledPosterior(model, subset, samples, likelihood=likelihood, sigma_noise=sigma_noise)
