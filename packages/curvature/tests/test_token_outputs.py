"""Token-level outputs ``[B, T, C]``: curvature and linearised predictive against dense float64 references.

Token classification (tiny BERT) and a causal LM (tiny Llama, labels shifted inside the model), with padding
and -100 positions that must not contribute; KFAC-expand's exact cases on per-token networks.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tiny_models import tiny_model

sys.path.insert(0, str(Path(__file__).parent))
from _token_refs import (
    TokenNet,
    bert_tagger,
    empirical_fisher,
    ggn,
    inputs,
    kept,
    llama_lm,
    lm_batch,
    output_jacobian,
    tagged_batch,
    targets,
)

from partialbayes.curvature import (
    DenseLaplace,
    DiagLaplace,
    KronLaplace,
    dense_curvature,
    diag_curvature,
    kfac,
    logit_jacobians,
)
from partialbayes.predictive import is_causal_lm, kept_positions, probit
from partialbayes.selection import (
    MaskBlock,
    Subset,
    linear_modules,
    modules,
    sparse_kfac,
)

FIXTURE = settings(
    max_examples=6,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    deadline=None,
)
MODELS = {"bert": (bert_tagger, tagged_batch, False), "llama": (llama_lm, lm_batch, True)}


def _on(batch, device):
    return {k: v.to(device) for k, v in batch.items()}


def _mask_subset(model, seed: int, fraction: float = 0.4) -> Subset:
    """An elementwise subset of every linear map (weights and biases)."""
    g = torch.Generator().manual_seed(seed)
    params = dict(model.named_parameters())
    blocks = {}
    for m in linear_modules(model):
        for kind in ("weight", "bias"):
            name = f"{m}.{kind}"
            if name in params:
                mask = torch.rand(params[name].shape, generator=g) < fraction
                mask.view(-1)[0] = True
                blocks[name] = MaskBlock(mask)
    return Subset.from_model(model, blocks)


def _model(kind, seed, device):
    make, batch_of, shift = MODELS[kind]
    return make(seed).to(device), batch_of, shift


# ----------------------------------------------------------------------------- diagonal and dense curvature
@FIXTURE
@given(
    kind=st.sampled_from(sorted(MODELS)),
    b=st.integers(1, 3),
    t=st.integers(3, 5),
    fisher=st.sampled_from(["exact", "empirical"]),
    seed=st.integers(0, 2**10),
)
def test_diag_and_dense_curvature_equal_dense_reference(device, kind, b, t, fisher, seed):
    model, batch_of, shift = _model(kind, seed, device)
    batch = _on(batch_of(b, t, seed), device)
    keep = kept(batch, shift)
    subset = _mask_subset(model, seed)
    logits, J = output_jacobian(model, batch, keep, subset)
    ref = (
        ggn(J, logits)
        if fisher == "exact"
        else empirical_fisher(J, logits, targets(batch, keep, shift))
    )
    H = dense_curvature(model, [batch], subset, fisher=fisher)
    torch.testing.assert_close(H, ref, rtol=1e-9, atol=1e-12)
    h = diag_curvature(model, [batch], subset, fisher=fisher)
    torch.testing.assert_close(torch.cat([h[n] for n in subset.names]), ref.diagonal())


def test_mc_fisher_of_token_outputs_is_unbiased():
    """``fisher="mc"`` draws every position's label in one pass: its mean is the GGN diagonal."""
    model = bert_tagger(1)
    batch = tagged_batch(2, 4, 1)
    subset = _mask_subset(model, 1)
    logits, J = output_jacobian(model, batch, kept(batch, False), subset)
    ref = ggn(J, logits).diagonal()
    n = 200
    draws = torch.stack(
        [
            torch.cat(
                list(
                    diag_curvature(
                        model,
                        [batch],
                        subset,
                        fisher="mc",
                        generator=torch.Generator().manual_seed(i),
                    ).values()
                )
            )
            for i in range(n)
        ]
    )
    err = (draws.mean(0) - ref).abs()
    bound = 5 * draws.std(0) / n**0.5 + 1e-12
    assert bool((err <= bound).all()), float((err / bound).max())


# ----------------------------------------------------------------------------- Kronecker factors
def _kron_block(factors, m):
    f = factors[m]
    return torch.kron(f.G, f.input_factor())


def _block_jacobian(model, batch, keep, module):
    """``(logits [N, C], J [N, C, r·(c+1)])`` of one linear map in the KFAC block order ``vec(W | b)``."""
    logits, J = output_jacobian(model, batch, keep, modules(model, [module]))
    w = dict(model.named_parameters())[f"{module}.weight"]
    n_out, n_in = w.shape
    if J.shape[-1] == n_out * n_in:  # no bias
        return logits, J
    Jw = J[..., : n_out * n_in].reshape(*J.shape[:2], n_out, n_in)
    Jb = J[..., n_out * n_in :].reshape(*J.shape[:2], n_out, 1)
    return logits, torch.cat([Jw, Jb], -1).reshape(*J.shape[:2], -1)


@FIXTURE
@given(
    b=st.integers(1, 3),
    t=st.integers(1, 5),
    fisher=st.sampled_from(["exact", "empirical"]),
    seed=st.integers(0, 2**10),
    module=st.sampled_from(["lin1", "head"]),
)
def test_kron_expand_exact_with_one_kept_position(device, b, t, fisher, seed, module):
    """One datum: every other position padded or labelled -100 — they must not enter ``G`` or ``A``."""
    g = torch.Generator().manual_seed(seed)
    model = TokenNet(3, 4, 3).double().eval().to(device)
    torch.manual_seed(seed)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.7)
    x = torch.randn(b, t, 3, generator=g, dtype=torch.float64)
    mask = (torch.rand(b, t, generator=g) > 0.4).long()
    bi, ti = (
        int(torch.randint(0, b, (1,), generator=g)),
        int(torch.randint(0, t, (1,), generator=g)),
    )
    mask[bi, ti] = 1
    labels = torch.full((b, t), -100)
    labels[bi, ti] = int(torch.randint(0, 3, (1,), generator=g))
    batch = _on({"x": x, "attention_mask": mask, "labels": labels}, device)
    factors = kfac(model, [batch], modules(model, [module]), sharing="expand", fisher=fisher)
    keep = kept(batch, False)
    assert int(keep.sum()) == 1
    logits, J = _block_jacobian(model, batch, keep, module)
    ref = (  # one datum: the GGN and the EF (g gᵀ) are both Kronecker products
        ggn(J, logits)
        if fisher == "exact"
        else empirical_fisher(J, logits, targets(batch, keep, False))
    )
    torch.testing.assert_close(_kron_block(factors, module), ref, rtol=1e-9, atol=1e-12)


@FIXTURE
@given(
    b=st.integers(1, 3),
    t=st.integers(1, 5),
    seed=st.integers(0, 2**10),
    module=st.sampled_from(["lin1", "head"]),
    sigma=st.floats(0.3, 2.0),
)
def test_kron_expand_exact_on_deep_linear_token_regression(device, b, t, seed, module, sigma):
    """Deep linear per-token network, Gaussian likelihood: KFAC-expand is exact over all kept positions."""
    g = torch.Generator().manual_seed(seed)
    model = TokenNet(3, 4, 2, act=False).double().eval().to(device)
    x = torch.randn(b, t + 1, 3, generator=g, dtype=torch.float64)
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    mask = (torch.arange(t + 1)[None] < lengths[:, None]).long()  # at least one padded position
    y = torch.randn(b, t + 1, 2, generator=g, dtype=torch.float64)
    batch = _on({"x": x, "attention_mask": mask, "labels": y}, device)
    factors = kfac(
        model,
        [batch],
        modules(model, [module]),
        sharing="expand",
        likelihood="regression",
        sigma_noise=sigma,
    )
    logits, J = _block_jacobian(model, batch, batch["attention_mask"].bool(), module)
    ref = ggn(J, logits, "regression", sigma)
    torch.testing.assert_close(_kron_block(factors, module), ref, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_kron_head_exact_with_one_kept_position_on_transformers(kind):
    """The output layer of BERT / Llama with one kept output: ``G ⊗ A`` is its exact GGN block."""
    model, batch_of, shift = _model(kind, 3, "cpu")
    batch = batch_of(3, 5, 3)
    keep = kept(batch, shift)
    first = keep.nonzero()[0]
    only = torch.full_like(batch["labels"], -100)
    if shift:
        only[first[0], first[1] + 1] = batch["labels"][first[0], first[1] + 1]
    else:
        only[first[0], first[1]] = batch["labels"][first[0], first[1]]
    batch = {**batch, "labels": only}
    keep = kept(batch, shift)
    assert int(keep.sum()) == 1
    head = "classifier" if kind == "bert" else "lm_head"
    subset = modules(model, [head])
    factors = kfac(model, [batch], subset, sharing="expand")
    logits, J = _block_jacobian(model, batch, keep, head)
    torch.testing.assert_close(_kron_block(factors, head), ggn(J, logits), rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("fn", ["kfac", "diag", "dense"])
def test_padding_does_not_contribute_on_bert(fn):
    """A padded batch gives the curvature of its unpadded sequences fed one at a time."""
    model = bert_tagger(2)
    batch = tagged_batch(3, 6, 2)
    lengths = batch["attention_mask"].sum(1).tolist()
    assert min(lengths) < 6  # some padding
    singles = [{k: v[i : i + 1, :n] for k, v in batch.items()} for i, n in enumerate(lengths)]
    subset = sparse_kfac(model, 50)
    if fn == "kfac":
        a, b = (kfac(model, data, subset, sharing="expand") for data in ([batch], singles))
        for m in a:
            torch.testing.assert_close(a[m].G, b[m].G)
            torch.testing.assert_close(a[m].A, b[m].A)
    elif fn == "diag":
        a, b = (diag_curvature(model, data, subset) for data in ([batch], singles))
        for n in a:
            torch.testing.assert_close(a[n], b[n])
    else:
        a, b = (dense_curvature(model, data, subset) for data in ([batch], singles))
        torch.testing.assert_close(a, b)


# ----------------------------------------------------------------------------- linearised predictive
def _kron_factors(la, seed):
    g = torch.Generator().manual_seed(seed)
    out = {}
    for m in la.modules:
        r, _, c = la._dims[m]
        xg = torch.randn(r, r, generator=g, dtype=torch.float64)
        xa = torch.randn(c, c, generator=g, dtype=torch.float64)
        out[m] = SimpleNamespace(G=xg @ xg.T, A=xa @ xa.T / c)
    return out


def _block_order(la, J, subset):
    """Reorder ``J [N, C, P]`` (subset order) into KronLaplace's block order."""
    start, per_param = 0, {}
    for n in subset.names:
        k = subset.num_entries(n)
        per_param[n] = J[..., start : start + k]
        start += k
    return torch.cat(
        [la.params_to_block(m, per_param).reshape(*J.shape[:2], -1) for m in la.modules], -1
    )


@FIXTURE
@given(
    kind=st.sampled_from(sorted(MODELS)),
    family=st.sampled_from(["kron", "diag", "dense"]),
    b=st.integers(1, 3),
    t=st.integers(3, 5),
    prior=st.floats(0.2, 5.0),
    chunk=st.sampled_from([None, 1, 2]),
    seed=st.integers(0, 2**10),
)
def test_linearised_covariance_equals_dense_reference(
    device, kind, family, b, t, prior, chunk, seed
):
    model, batch_of, shift = _model(kind, seed, device)
    batch = _on(batch_of(b, t, seed), device)
    keep = kept(batch, shift)
    if family == "kron":
        subset = sparse_kfac(model, 50)
        la = KronLaplace(model, subset, prior_precision=prior, sharing="expand")
        factors = _kron_factors(la, seed)
        la.fit_curvature(factors, map_loss=1.0, n_data=5, n_outputs=3)
        P = torch.block_diag(
            *[
                torch.kron(factors[m].G, factors[m].A)
                + prior
                * torch.eye(factors[m].G.shape[0] * factors[m].A.shape[0], dtype=torch.float64)
                for m in la.modules
            ]
        )
        logits, J = output_jacobian(model, batch, keep, subset)
        J = _block_order(la, J, subset)
    else:
        subset = _mask_subset(model, seed, 0.2)
        logits, J = output_jacobian(model, batch, keep, subset)
        p = subset.num_entries()
        g = torch.Generator().manual_seed(seed)
        if family == "diag":
            la = DiagLaplace(model, subset, prior_precision=prior)
            h = torch.rand(p, generator=g, dtype=torch.float64) * 3
            start, curv = 0, {}
            for n in subset.names:
                k = subset.num_entries(n)
                curv[n] = h[start : start + k]
                start += k
            la.fit_curvature(curv, map_loss=1.0, n_data=5, n_outputs=3)
            P = torch.diag(h + prior)
        else:
            la = DenseLaplace(model, subset, prior_precision=prior)
            x = torch.randn(p, p, generator=g, dtype=torch.float64)
            H = x @ x.T / p
            la.fit_curvature(H, map_loss=1.0, n_data=5, n_outputs=3)
            P = H + prior * torch.eye(p, dtype=torch.float64)
    ref = J.cpu() @ torch.linalg.inv(P) @ J.cpu().mT
    f, cov = la.logit_mean_cov(batch, chunk_size=chunk)
    torch.testing.assert_close(f, logits)
    torch.testing.assert_close(cov.cpu(), ref, rtol=1e-7, atol=1e-10)
    # the Jacobians themselves, through the public function (Kronecker subsets)
    if family == "kron":
        rows, blocks = logit_jacobians(model, batch, subset)
        torch.testing.assert_close(rows, logits)
        got = torch.cat([blocks[m].reshape(*blocks[m].shape[:2], -1) for m in la.modules], -1)
        torch.testing.assert_close(got, J)


def test_predict_treats_positions_the_same_with_or_without_labels():
    """Issue #25: predict gave the MAP softmax at positions labelled -100 when labels were present and the
    Bayesian predictive when absent. Labels are ignored now: every real position is predicted, padding
    holds softmax(f); logit_mean_cov keeps only the labelled positions, at the same values."""
    model = bert_tagger(4)
    batch = tagged_batch(3, 5, 4, ignore=0.4)
    la = KronLaplace(model, sparse_kfac(model, 50)).fit([batch])
    assert la.sharing == "expand"  # chosen from the token-level outputs
    probs = la.predict(batch)
    torch.testing.assert_close(la.predict(inputs(batch)), probs)
    relabelled = {**batch, "labels": (batch["labels"] + 1) % 3}
    torch.testing.assert_close(la.predict(relabelled), probs)
    keep = kept(batch, False)
    real = batch["attention_mask"].bool()
    logits = model(**inputs(batch)).logits.detach()
    torch.testing.assert_close(probs[~real], torch.softmax(logits, -1)[~real])
    assert not torch.allclose(probs[real & ~keep], torch.softmax(logits, -1)[real & ~keep])
    f, cov = la.logit_mean_cov(batch)
    torch.testing.assert_close(probs[keep], probit(f, cov))
    # keeping only the labelled positions of predict's output: predictive.kept_positions
    labelled = kept_positions(
        logits, attention_mask=batch["attention_mask"], labels=batch["labels"]
    )
    torch.testing.assert_close(probs[labelled], probit(f, cov))


# ----------------------------------------------------------------------------- causal LMs: the shift
def test_causal_lm_shift_matches_hugging_face_loss():
    model = llama_lm(5)
    batch = lm_batch(3, 6, 5)
    batch["labels"][batch["attention_mask"] == 0] = -100  # Hugging Face counts padding unless -100
    hf = model(**batch).loss.detach()
    subset = modules(model, ["lm_head"])
    la = KronLaplace(model, subset, sharing="expand").fit([batch])
    assert la.shift_labels
    assert la.n_data == int(kept(batch, True).sum())
    torch.testing.assert_close(torch.tensor(la.map_loss / la.n_data), hf)
    # the unshifted convention scores the logits against the wrong tokens: another loss
    wrong = KronLaplace(model, subset, sharing="expand", shift_labels=False).fit([batch])
    assert abs(wrong.map_loss / wrong.n_data - float(hf)) > 1e-3


def test_causal_lm_detection():
    assert is_causal_lm(llama_lm())
    assert is_causal_lm(tiny_model("gpt2", "causal-lm", vocab=10))
    assert not is_causal_lm(bert_tagger())
    assert not is_causal_lm(TokenNet(2, 2, 2))
    assert not KronLaplace(bert_tagger(), sparse_kfac(bert_tagger(), 50)).shift_labels
    with pytest.raises(TypeError, match="shift_labels must be a bool"):
        KronLaplace(bert_tagger(), sparse_kfac(bert_tagger(), 50), shift_labels="yes")


# ----------------------------------------------------------------------------- bad input
def test_token_logits_without_mask_or_labels_are_refused():
    model = bert_tagger()
    batch = tagged_batch(2, 4, 0)
    subset = sparse_kfac(model, 50)
    with pytest.raises(ValueError, match=r"batch 0: token-level logits .* need an attention_mask"):
        kfac(model, [batch["input_ids"]], subset, sharing="expand")
    with pytest.raises(ValueError, match=r"batch 0: token-level logits .* need an attention_mask"):
        diag_curvature(model, [batch["input_ids"]], subset)
    la = KronLaplace(model, subset, sharing="expand").fit([batch])
    for call in (la.predict, la.logit_mean_cov, lambda x: la.predictive_samples(x, 2)):
        with pytest.raises(ValueError, match="need an attention_mask or labels"):
            call(batch["input_ids"])
    with pytest.raises(ValueError, match="need an attention_mask or labels"):
        logit_jacobians(model, batch["input_ids"], subset)


def test_reduce_sharing_is_refused_for_token_outputs_and_expand_is_the_default(tmp_path):
    model = bert_tagger()
    with pytest.raises(ValueError, match=r"batch 0: .*token-level logits.*Pass sharing='expand'"):
        KronLaplace(model, sparse_kfac(model, 50), sharing="reduce").fit([tagged_batch(2, 4, 0)])
    subset = sparse_kfac(model, 50)
    chosen = KronLaplace(model, subset).fit([tagged_batch(2, 4, 0)])
    given = KronLaplace(model, subset, sharing="expand").fit([tagged_batch(2, 4, 0)])
    assert chosen.sharing == given.sharing == "expand"
    assert "sharing=expand" in chosen.summary()
    assert "sharing=expand" in repr(chosen)
    chosen.save(tmp_path / "chosen.safetensors")
    assert KronLaplace.load(tmp_path / "chosen.safetensors", model).sharing == "expand"
    torch.testing.assert_close(
        chosen.logit_mean_cov(tagged_batch(2, 4, 1)), given.logit_mean_cov(tagged_batch(2, 4, 1))
    )
    factors = kfac(model, [tagged_batch(2, 4, 0)], subset)
    assert {f.sharing for f in factors.values()} == {"expand"}
    with pytest.raises(ValueError, match=r"factors computed with sharing \['expand'\]"):
        KronLaplace(model, subset, sharing="reduce").fit_curvature(
            factors, map_loss=1.0, n_data=2, n_outputs=3
        )


def test_shift_labels_needs_token_level_classification():
    model = TokenNet(3, 4, 2).eval()
    x = torch.randn(2, 3, 3)
    batch = {"x": x, "attention_mask": torch.ones(2, 3), "labels": torch.randn(2, 3, 2)}
    with pytest.raises(ValueError, match=r"shift_labels=True .* needs likelihood='classification'"):
        kfac(
            model,
            [batch],
            modules(model, ["head"]),
            sharing="expand",
            likelihood="regression",
            shift_labels=True,
        )
    seq = torch.nn.Sequential(torch.nn.Linear(3, 2)).eval()
    with pytest.raises(ValueError, match=r"shift_labels=True is for token-level logits"):
        kfac(seq, [(x[:, 0], torch.tensor([0, 1]))], modules(seq, ["0"]), shift_labels=True)


@pytest.mark.parametrize("fisher", ["exact", "empirical"])
@pytest.mark.parametrize("fn", ["kfac", "diag", "dense"])
def test_a_batch_without_kept_positions_is_skipped_with_one_warning(fn, fisher):
    """Issue #27: a batch whose labels are all -100 is skipped and counted (one warning at the end)."""
    model = bert_tagger(6)
    good = tagged_batch(2, 4, 6)
    empty = tagged_batch(2, 4, 7)
    empty["labels"] = torch.full_like(empty["labels"], -100)
    subset = sparse_kfac(model, 40)
    call = {
        "kfac": lambda data: kfac(model, data, subset, sharing="expand", fisher=fisher),
        "diag": lambda data: diag_curvature(model, data, subset, fisher=fisher),
        "dense": lambda data: dense_curvature(model, data, subset, fisher=fisher),
    }[fn]
    with pytest.warns(UserWarning, match="skipped 2 of 3 batches with no labelled outputs") as rec:
        a = call([empty, good, empty])
    assert len(rec) == 1
    assert rec[0].filename == __file__
    b = call([good])
    if fn == "kfac":
        for m in a:
            torch.testing.assert_close(a[m].G, b[m].G)
            torch.testing.assert_close(a[m].A, b[m].A)
    elif fn == "diag":
        for n in a:
            torch.testing.assert_close(a[n], b[n])
    else:
        torch.testing.assert_close(a, b)
    with pytest.raises(ValueError, match=r"every batch of the loader \(2\) has no labelled output"):
        call([empty, empty])
    with pytest.warns(UserWarning, match="skipped 1 of 2 batches"):
        la = DenseLaplace(model, subset).fit([good, empty])
    assert la.n_data == int(kept(good, False).sum())
    with pytest.raises(ValueError, match="every output of the batch is labelled -100"):
        la.logit_mean_cov(empty)
    real = empty["attention_mask"].bool()
    logits = model(**inputs(empty)).logits.detach()
    probs = la.predict(empty)  # labels ignored: the predictive at every real position
    torch.testing.assert_close(probs[~real], torch.softmax(logits, -1)[~real])
    assert not torch.allclose(probs[real], torch.softmax(logits, -1)[real])
    with pytest.warns(UserWarning, match="skipped 1 of 2 validation batches"):
        la.grid_val_nll([empty, good], torch.tensor([1.0]))
    with pytest.raises(ValueError, match="every batch of val_loader"):
        la.grid_val_nll([empty], torch.tensor([1.0]))


def test_next_token_after_a_prompt_by_appending_a_labelled_token():
    """The how-to's recipe: append any token, label only it; logit_mean_cov computes that position alone."""
    model = llama_lm(8)
    la = KronLaplace(model, sparse_kfac(model, 50), sharing="expand").fit([lm_batch(2, 5, 8)])
    prompt = torch.randint(1, 11, (2, 4), generator=torch.Generator().manual_seed(8))
    mask = torch.ones_like(prompt)
    every = la.predict({"input_ids": prompt, "attention_mask": mask})  # no labels: all real tokens
    longer = torch.cat([prompt, torch.ones_like(prompt[:, :1])], 1)
    labels = torch.full_like(longer, -100)
    labels[:, -1] = 1
    only = la.predict(
        {"input_ids": longer, "attention_mask": torch.ones_like(longer), "labels": labels}
    )
    torch.testing.assert_close(only[:, 3], every[:, 3])
    f, cov = la.logit_mean_cov(
        {"input_ids": longer, "attention_mask": torch.ones_like(longer), "labels": labels}
    )
    assert f.shape == (2, 11)
    assert cov.shape == (2, 11, 11)
    torch.testing.assert_close(probit(f, cov), every[:, 3])


def test_generic_jacobians_of_token_outputs_for_parameters_outside_linear_maps():
    """A LayerNorm in the subset: the predictive falls back to batched autograd, per kept position."""
    model = bert_tagger(9)
    batch = tagged_batch(3, 5, 9)
    keep = kept(batch, False)
    names = ["bert.encoder.layer.0.output.LayerNorm.weight", "classifier.bias"]
    subset = Subset.from_model(
        model,
        {
            n: MaskBlock(torch.ones_like(dict(model.named_parameters())[n], dtype=torch.bool))
            for n in names
        },
    )
    la = DiagLaplace(model, subset, prior_precision=0.7)
    g = torch.Generator().manual_seed(9)
    h = {n: torch.rand(subset.num_entries(n), generator=g, dtype=torch.float64) for n in names}
    la.fit_curvature(h, map_loss=1.0, n_data=3, n_outputs=3)
    logits, J = output_jacobian(model, batch, keep, subset)
    sigma = 1 / (torch.cat([h[n] for n in names]) + 0.7)
    f, cov = la.logit_mean_cov(batch)
    torch.testing.assert_close(f, logits)
    torch.testing.assert_close(cov, (J * sigma) @ J.mT)


def test_a_round_of_backward_passes_takes_one_kept_position_of_every_example():
    """Answers at different positions are backpropagated together: one round per answer of an example."""
    from partialbayes.curvature._likelihood import position_plan

    keep = torch.zeros(3, 6, dtype=torch.bool)
    keep[0, 5] = keep[1, 2] = keep[2, 4] = keep[2, 1] = True
    plan = position_plan(keep, 3, keep.device)
    assert [(t.tolist(), b.tolist()) for t, b in plan] == [([5, 2, 1], [0, 1, 2]), ([4], [2])]
    assert position_plan(torch.zeros(2, 3, dtype=torch.bool), 2, keep.device) == []
