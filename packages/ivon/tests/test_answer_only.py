"""Answer-only predictives (``target_ids``) of IVON posteriors on a tiny causal LM, against explicit references.

The reference swaps each weight sample in by hand, runs the model and reads the answer tokens' logits at the
position before each labelled answer (the causal-LM shift) — no library answer-position code.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from partialbayes.ivon import GaussianPosterior, MultiIVON
from partialbayes.predictive.testing import check_posterior

pytest.importorskip("transformers")
from tiny_models import tiny_model

FIXTURE = settings(
    max_examples=6,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    deadline=None,
)
PARAMS = ("transformer.h.0.attn.c_attn.weight", "transformer.wte.weight", "transformer.ln_f.bias")


def gaussian(model: torch.nn.Module, seed: int) -> GaussianPosterior:
    """Means = the model's weights; σ > 0 on some entries of ``PARAMS`` (the subset), 0 elsewhere."""
    g = torch.Generator().manual_seed(seed)
    params = dict(model.named_parameters())
    mean = {n: params[n].detach().clone() for n in PARAMS}
    std = {}
    for n in PARAMS:
        s = 0.2 * torch.rand(mean[n].shape, generator=g, dtype=mean[n].dtype)
        std[n] = (s * (torch.rand(s.shape, generator=g) < 0.5)).to(mean[n].device)
    return GaussianPosterior(mean, std, model)


def answer_batch(b: int, t: int, seed: int, device: torch.device) -> tuple[dict, torch.Tensor]:
    """Prompts of various lengths with one labelled answer token each; returns the answers' positions."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 30, (b, t), generator=g)
    answer = torch.randint(1, t, (b,), generator=g)
    mask = (torch.arange(t)[None] <= answer[:, None]).long()
    labels = torch.full_like(ids, -100)
    labels[torch.arange(b), answer] = ids[torch.arange(b), answer]
    batch = {"input_ids": ids * mask, "attention_mask": mask, "labels": labels}
    return {k: v.to(device) for k, v in batch.items()}, answer


@given(seed=st.integers(0, 2**16), b=st.integers(1, 4), t=st.integers(2, 7))
@FIXTURE
def test_answer_only_predictive_equals_the_explicit_reference(seed, b, t, device):
    model = tiny_model("gpt2", "causal-lm", seed=seed % 5).double().to(device).eval()
    post = gaussian(model, seed)
    batch, answer = answer_batch(b, t, seed, device)
    ids = [11, 2, 7]
    n = 4
    g = torch.Generator(device)
    draws = post.predictive_samples(batch, n, target_ids=ids, generator=g.manual_seed(seed))
    g.manual_seed(seed)
    ref = []
    with torch.no_grad():
        for _ in range(n):
            with post.sampled(generator=g):
                logits = model(batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            ref.append(
                logits[torch.arange(b), answer - 1][:, ids]
            )  # the position before the answer
    torch.testing.assert_close(draws, torch.stack(ref), rtol=0, atol=0)
    probs = post.predict(batch, target_ids=ids, n_samples=n, generator=g.manual_seed(seed))
    assert isinstance(probs, torch.Tensor)
    torch.testing.assert_close(probs, torch.stack(ref).softmax(-1).mean(0))

    mix = MultiIVON([post, gaussian(model, seed + 1)])
    full = mix.predictive_samples(batch, n, generator=g.manual_seed(seed))
    draws = mix.predictive_samples(batch, n, target_ids=ids, generator=g.manual_seed(seed))
    torch.testing.assert_close(draws, full[:, torch.arange(b), answer - 1][..., ids])
    probs = mix.predict(batch, target_ids=ids, n_samples=n, generator=g.manual_seed(seed))
    assert isinstance(probs, torch.Tensor)
    torch.testing.assert_close(probs, draws.softmax(-1).mean(0))


def test_answer_only_conformance_and_bad_ids(device, tmp_path):
    model = tiny_model("gpt2", "causal-lm", seed=0).double().to(device).eval()
    post = gaussian(model, 0)
    batch, _ = answer_batch(3, 6, 0, device)
    check_posterior(post, batch, tmp_path / "gaussian.safetensors")  # its target_ids case included
    check_posterior(MultiIVON([post, gaussian(model, 1)]), batch, tmp_path / "mix.safetensors")
    with pytest.raises(ValueError, match="target_ids: 2 is repeated"):
        post.predict(batch, target_ids=[2, 5, 2])
    vocab = model.config.vocab_size
    with pytest.raises(ValueError, match=rf"target_ids: {vocab} is out of range"):
        post.predictive_samples(batch, 2, target_ids=[0, vocab])
    regression = GaussianPosterior(post.mean, post.std, model, likelihood="regression")
    with pytest.raises(ValueError, match="target_ids selects answer tokens of a classifier"):
        regression.predict(batch, target_ids=[1, 2])
