"""Conformance checks for `Posterior` implementations (ours, or a user's own family).

`check_posterior` drives a fitted posterior through the whole protocol and raises ``AssertionError`` with
a message naming the first rule it breaks. Every family in partialbayes runs it in its tests.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from partialbayes.predictive._answers import answer_positions
from partialbayes.predictive._batch import is_causal_lm, model_logits, split_batch
from partialbayes.predictive._posterior import Posterior, rows


class _Boom(Exception):
    """Raised inside `swapped` to check that the MAP comes back on error."""


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise AssertionError(message)


def _state(model: nn.Module) -> dict[str, Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _assert_state(model: nn.Module, expected: Mapping[str, Tensor], when: str) -> None:
    for name, p in model.named_parameters():
        _require(
            torch.equal(p.detach(), expected[name]),
            f"parameter {name!r} differs from the MAP {when}",
        )


def _generator(seed: int, model: nn.Module) -> torch.Generator:
    device = next(model.parameters()).device
    return torch.Generator(device=device).manual_seed(seed)


def _check_samples(post: Posterior, n: int, seed: int) -> dict[str, Tensor]:
    subset = post.subset
    draws = post.sample(n, generator=_generator(seed, post.model))
    _require(
        list(draws) == list(subset.names),
        f"sample() keys {list(draws)} must be the subset's names in order {list(subset.names)}",
    )
    params = dict(post.model.named_parameters())
    for name, values in draws.items():
        k = subset.num_entries(name)
        where = f"sample({n})[{name!r}]"
        shape = tuple(values.shape)
        _require(shape == (n, k), f"{where} has shape {shape}, expected [n, k] = {(n, k)}")
        _require(bool(torch.isfinite(values).all()), f"{where} holds non-finite values")
        device = params[name].device
        _require(values.device == device, f"{where} is on {values.device}, the model on {device}")
    again = post.sample(n, generator=_generator(seed, post.model))
    for name in draws:
        _require(
            torch.equal(draws[name], again[name]),
            f"sample() is not reproducible from the generator ({name!r})",
        )
    return draws


def _check_swapping(post: Posterior, draws: Mapping[str, Tensor], seed: int) -> None:
    model = post.model
    before = _state(model)
    one = rows(draws, 0)
    with post.swapped(one) as swapped_model:
        _require(swapped_model is model, "swapped() must yield the posterior's model")
        params = dict(model.named_parameters())
        for name in post.subset.names:
            got = post.subset.gather(name, params[name].detach())
            wrote = torch.equal(got, one[name].to(device=got.device, dtype=got.dtype))
            _require(wrote, f"swapped() did not write the sample into {name!r}")
            outside = ~post.subset.mask(name).to(params[name].device)
            kept = torch.equal(params[name].detach()[outside], before[name][outside])
            _require(kept, f"swapped() changed entries of {name!r} outside the subset")
    _assert_state(model, before, "after swapped()")
    try:
        with post.swapped(one):
            raise _Boom
    except _Boom:
        pass
    _assert_state(model, before, "after an error inside swapped()")
    try:
        with post.sampled(generator=_generator(seed, model)):
            raise _Boom
    except _Boom:
        pass
    _assert_state(model, before, "after an error inside sampled()")
    name = post.subset.names[0]
    poisoned = {**one, name: one[name].clone()}
    poisoned[name].view(-1)[0] = float("nan")
    try:
        with post.swapped(poisoned):
            pass
    except ValueError:
        pass
    else:
        raise AssertionError("swapped() must refuse a sample with NaN entries (a ValueError)")
    _assert_state(model, before, "after swapped() refused a NaN sample")


def _check_predict(post: Posterior, batch: Any, regression: bool, seed: int) -> Any:
    device = next(post.model.parameters()).device
    with torch.no_grad():
        logits = model_logits(post.model, split_batch(batch, device=device).inputs)
    out: dict[str, Any] = {}
    for link in post.links:
        pred = post.predict(batch, link=link, n_samples=8, generator=_generator(seed, post.model))
        if regression:
            mean, var = pred
            _require(
                mean.shape == logits.shape == var.shape,
                f"predict(link={link!r}) gave mean {tuple(mean.shape)} and variance "
                f"{tuple(var.shape)}; the model's outputs are {tuple(logits.shape)}",
            )
            ok = bool(torch.isfinite(var).all()) and not bool((var < 0).any())
            _require(ok, f"predict(link={link!r}) variance is negative or non-finite")
        else:
            _require(
                isinstance(pred, Tensor) and pred.shape == logits.shape,
                f"predict(link={link!r}) must return probabilities of the logits' shape "
                f"{tuple(logits.shape)}, got {getattr(pred, 'shape', type(pred).__name__)}",
            )
            ok = bool(torch.isfinite(pred).all()) and not bool((pred < 0).any())
            _require(ok, f"predict(link={link!r}) gave negative or non-finite values")
            err = float((pred.sum(-1) - 1).abs().max())
            _require(err <= 1e-5, f"predict(link={link!r}) rows sum to 1 ± {err:.2e}")
        out[link] = pred
    try:
        post.predict(batch, link="no-such-link")
    except ValueError as err:
        listed = all(link in str(err) for link in post.links)
        _require(listed, f"an unknown link's error must list the offered links: {err}")
    else:
        raise AssertionError("predict(link='no-such-link') must raise ValueError")
    samples = post.predictive_samples(batch, 3, generator=_generator(seed, post.model))
    _require(
        tuple(samples.shape) == (3, *logits.shape),
        f"predictive_samples(batch, 3) has shape {tuple(samples.shape)}, expected {(3, *logits.shape)}",
    )
    _require(bool(torch.isfinite(samples).all()), "predictive_samples gave non-finite logits")
    return out


def _check_answers(post: Posterior, batch: Any, seed: int) -> None:
    """``target_ids``: ``[P, K]`` answer probabilities in the ids' order, ``[n, P, K]`` draws, bad ids refused."""
    b = split_batch(batch, device=next(post.model.parameters()).device)
    with torch.no_grad():
        logits = model_logits(post.model, b.inputs)
    c, causal = logits.shape[-1], is_causal_lm(post.model)
    if c < 2:
        return
    keep = answer_positions(
        logits, labels=b.labels, attention_mask=b.attention_mask, causal_lm=causal
    )
    shape = (logits.shape[0] if keep is None else int(keep.sum()), 2)
    gen = [_generator(seed, post.model) for _ in range(3)]
    probs = post.predict(batch, target_ids=[c - 1, 0], n_samples=8, generator=gen[0])
    flipped = post.predict(batch, target_ids=[0, c - 1], n_samples=8, generator=gen[1])
    draws = post.predictive_samples(batch, 3, target_ids=[c - 1, 0], generator=gen[2])
    ok = isinstance(probs, Tensor) and isinstance(flipped, Tensor) and probs.shape == shape
    _require(
        ok and tuple(draws.shape) == (3, *shape),
        f"target_ids=[{c - 1}, 0] must give [P, K] = {shape} (draws [n, P, K])",
    )
    assert isinstance(probs, Tensor)
    assert isinstance(flipped, Tensor)
    _require(
        float((probs.sum(-1) - 1).abs().max()) <= 1e-5 and torch.allclose(probs, flipped.flip(-1)),
        "predict(target_ids=...) must renormalise over the ids, in their order",
    )
    for bad in ([0, 0], [c]):
        try:
            post.predict(batch, target_ids=bad)
        except ValueError:
            continue
        _require(False, f"predict(target_ids={bad}) must raise ValueError (repeated/out of range)")


def check_posterior(
    posterior: Posterior,
    batch: Any,
    path: str | os.PathLike[str],
    *,
    regression: bool = False,
    seed: int = 0,
) -> None:
    """Drive a fitted posterior through the `Posterior` protocol; raise ``AssertionError`` on a breach.

    Checked: it is a `Posterior`; ``sample(n)`` gives ``{name: [n, k]}`` in subset order, finite, on the
    model's device, reproducible from a generator; ``swapped`` writes exactly the subset's entries, yields
    the model and restores every parameter bit for bit, also when the body raises (and so does
    ``sampled``), and refuses a sample with NaN entries with a ``ValueError``; ``predict`` with every
    offered link returns probabilities of the logits' shape that sum to one (regression: a mean and a non-negative variance of that shape); an unknown link is a
    ``ValueError`` listing the offered ones; ``predictive_samples`` has shape ``[n, *logits]``; and
    ``save`` → ``load`` onto the same model gives identical predictions. Classification with two or more
    outputs: ``predict(target_ids=ids)`` is ``[P, K]`` (the answer positions of
    ``partialbayes.predictive.answer_positions``) of probabilities that sum to one and follow the order of
    ``ids``, ``predictive_samples(..., target_ids=ids)`` is ``[n, P, K]``, and repeated or out-of-range ids
    are a ``ValueError``.

    Args:
        posterior: A fitted posterior.
        batch: One batch in any accepted form (labels are ignored).
        path: File to save to (a temporary path).
        regression: The posterior's likelihood is Gaussian regression.
        seed: Seed of the generators passed to the sampling calls.
    """
    if not isinstance(posterior, Posterior):
        names = [*Posterior.__annotations__, *(m for m in vars(Posterior) if m[0] != "_")]
        missing = [m for m in names if not hasattr(posterior, m)]
        raise AssertionError(f"{type(posterior).__name__} is not a Posterior: missing {missing}")
    _require(bool(posterior.links), "links must name at least one link")
    floats = posterior.num_floats
    _require(
        isinstance(floats, int) and not isinstance(floats, bool),
        f"num_floats must be an int, got {floats!r}",
    )
    draws = _check_samples(posterior, 3, seed)
    _check_swapping(posterior, draws, seed)
    before = _check_predict(posterior, batch, regression, seed)
    if not regression:
        _check_answers(posterior, batch, seed)
    posterior.save(path)
    loaded = type(posterior).load(path, posterior.model)
    after = _check_predict(loaded, batch, regression, seed)
    for link, pred in before.items():
        got = after[link]
        pairs = zip(pred, got, strict=True) if regression else [(pred, got)]
        for a, b in pairs:
            _require(torch.equal(a, b), f"predict(link={link!r}) changed after save -> load")
