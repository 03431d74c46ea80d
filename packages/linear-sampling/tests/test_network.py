import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from partialbayes.linear_sampling import (
    Features,
    Prior,
    linearised_logit_moments,
    linearised_logit_samples,
    linearised_targets,
    network_features,
    network_logits,
    network_parameters,
    posterior_mean,
    posterior_samples,
    softmax_hessian,
)
from partialbayes.selection import MaskBlock, Subset

F64 = torch.float64
FIXTURE_OK = settings(
    suppress_health_check=[
        HealthCheck.function_scoped_fixture,
        HealthCheck.too_slow,
        HealthCheck.differing_executors,
    ]
)


def mlp(n_in, hidden, n_out, seed, device):
    torch.manual_seed(seed)
    return (
        nn.Sequential(nn.Linear(n_in, hidden), nn.Tanh(), nn.Linear(hidden, n_out))
        .to(device, F64)
        .eval()
    )


def dense_jacobian(model, x, params):
    """[n, m, d] Jacobian of the logits in the flat chosen entries, by autograd on a flat vector."""
    named = dict(model.named_parameters())
    theta = network_parameters(model, params)
    spec = params if isinstance(params, dict) else dict.fromkeys(params)
    names = [n for n in named if n in spec]

    def f(flat):
        p, start = {}, 0
        for nm in names:
            mask = spec[nm]
            size = int(mask.sum()) if mask is not None else named[nm].numel()
            chunk = flat[start : start + size]
            start += size
            if mask is None:
                p[nm] = chunk.reshape(named[nm].shape)
            else:
                p[nm] = named[nm].detach().masked_scatter(mask, chunk)
        return torch.func.functional_call(model, p, (x,))

    return torch.autograd.functional.jacobian(f, theta)


def choose(model, how, seed):
    g = torch.Generator().manual_seed(seed)
    if how == "names":
        return ["0.weight", "2.bias"]
    if how == "all":
        return [n for n, _ in model.named_parameters()]
    masks = {}
    for nm, p in model.named_parameters():
        if nm.startswith("0.") or nm == "2.weight":
            mask = torch.rand(p.shape, generator=g) < 0.5
            mask.view(-1)[0] = True
            masks[nm] = mask.to(p.device)
    return masks


@FIXTURE_OK
@given(
    n=st.integers(1, 6),
    n_in=st.integers(1, 4),
    hidden=st.integers(1, 5),
    n_out=st.integers(1, 3),
    seed=st.integers(0, 2**16),
    how=st.sampled_from(["names", "all", "masks"]),
)
def test_network_features_match_dense_jacobian(device, n, n_in, hidden, n_out, seed, how):
    model = mlp(n_in, hidden, n_out, seed, device)
    x = torch.randn(n, n_in, dtype=F64, device=device)
    params = choose(model, how, seed)
    jac = dense_jacobian(model, x, params)
    feats = network_features(model, x, params)
    assert (feats.n, feats.m, feats.d) == tuple(jac.shape)
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(feats.d, 2, generator=g, dtype=F64).to(device)
    v = torch.randn(n, n_out, 2, generator=g, dtype=F64).to(device)
    idx = torch.arange(n, device=device).flip(0)
    torch.testing.assert_close(feats.apply(idx, z), torch.einsum("nmd,dk->nmk", jac[idx], z))
    torch.testing.assert_close(feats.apply_t(idx, v), torch.einsum("nmd,nmk->dk", jac[idx], v))


def dense_linearised_laplace(model, x_train, x_test, params, alpha, jitter):
    j = dense_jacobian(model, x_train, params)
    js = dense_jacobian(model, x_test, params)
    logits = model(x_train).detach()
    p = logits.softmax(-1)
    b = (
        torch.diag_embed(p)
        - p.unsqueeze(2) * p.unsqueeze(1)
        + jitter * torch.eye(p.shape[1], dtype=F64, device=p.device)
    )
    ggn = torch.einsum("nmd,nmk,nke->de", j, b, j)  # exact GGN of the summed cross-entropy
    h = ggn + alpha * torch.eye(j.shape[2], dtype=F64, device=j.device)
    cov = torch.einsum("nmd,de,nke->nmk", js, torch.linalg.inv(h), js)
    return model(x_test).detach(), cov, h


@pytest.mark.parametrize("how", ["names", "masks", "all"])
def test_linearised_laplace_matches_dense_ggn_laplace(device, how):
    model = mlp(3, 6, 3, 0, device)
    g = torch.Generator().manual_seed(1)
    x_train = torch.randn(25, 3, generator=g, dtype=F64).to(device)
    x_test = torch.randn(5, 3, generator=g, dtype=F64).to(device)
    params = choose(model, how, 0)
    mean_ref, cov_ref, _h = dense_linearised_laplace(model, x_train, x_test, params, 0.7, 1e-4)
    train = network_features(model, x_train, params)
    noise = softmax_hessian(network_logits(model, x_train), jitter=1e-4)
    prior = Prior(0.7)
    mean, cov = linearised_logit_moments(
        model,
        x_test,
        params,
        train_features=train,
        noise=noise,
        prior=prior,
        batch_size=2,
        tol=1e-12,
    )
    torch.testing.assert_close(mean, mean_ref)
    torch.testing.assert_close(cov, cov_ref, rtol=1e-6, atol=1e-9)

    k = 2000
    dense_train = Features.dense(
        dense_jacobian(model, x_train, params)
    )  # sampling cost is not under test here
    z = posterior_samples(
        dense_train, noise, prior, k, method="cg", generator=torch.Generator().manual_seed(0)
    ).samples
    _, cov_mc = linearised_logit_moments(model, x_test, params, samples=z)
    var = cov_ref.diagonal(dim1=1, dim2=2)
    se = ((var.unsqueeze(2) * var.unsqueeze(1) + cov_ref**2) / k).sqrt()
    assert bool(((cov_mc - cov_ref).abs() <= 5 * se).all())

    samples = linearised_logit_samples(model, x_test, params, z[:, :4])
    js = dense_jacobian(model, x_test, params)
    torch.testing.assert_close(samples, mean_ref + torch.einsum("nmd,dk->knm", js, z[:, :4]))


def tiny_hf(kind):
    pytest.importorskip("transformers")
    from tiny_models import tiny_model

    tokens = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 1} if kind == "gpt2" else {}
    return tiny_model(kind, seed=0, size="s", num_labels=3, **tokens).eval()


@pytest.mark.parametrize("kind", ["distilbert", "gpt2"])
def test_tiny_hf_features_are_adjoint_and_match_finite_differences(device, kind, float64_default):
    model = tiny_hf(kind).to(device=device, dtype=F64)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 50, (6, 7), generator=g)
    mask = torch.ones(6, 7, dtype=torch.long)
    mask[3:, 5:] = 0
    inputs = {"input_ids": ids.to(device), "attention_mask": mask.to(device)}
    names = [
        n
        for n, _ in model.named_parameters()
        if "embeddings" not in n and "wte" not in n and "wpe" not in n
    ]
    feats = network_features(model, inputs, names)
    assert feats.m == 3
    idx = torch.tensor([4, 0, 2], device=device)
    z = torch.randn(feats.d, 2, generator=g, dtype=F64).to(device)
    v = torch.randn(3, 3, 2, generator=g, dtype=F64).to(device)
    jz, jtv = feats.apply(idx, z), feats.apply_t(idx, v)
    torch.testing.assert_close((jz * v).sum(), (z * jtv).sum())
    # central differences along z[:, 0]
    named = dict(model.named_parameters())
    theta = network_parameters(model, names)
    eps = 1e-5

    def logits_at(flat):
        p, start = {}, 0
        for nm in names:
            size = named[nm].numel()
            p[nm] = flat[start : start + size].reshape(named[nm].shape)
            start += size
        batch = {k: t[idx] for k, t in inputs.items()}
        return torch.func.functional_call(model, p, (), batch).logits.detach()

    fd = (logits_at(theta + eps * z[:, 0]) - logits_at(theta - eps * z[:, 0])) / (2 * eps)
    torch.testing.assert_close(jz[..., 0], fd, rtol=1e-5, atol=1e-7)


def test_tiny_hf_linearised_laplace_end_to_end():
    model = tiny_hf("distilbert")
    g = torch.Generator().manual_seed(0)
    train = {
        "input_ids": torch.randint(1, 50, (12, 6), generator=g),
        "attention_mask": torch.ones(12, 6, dtype=torch.long),
    }
    test = {
        "input_ids": torch.randint(1, 50, (3, 6), generator=g),
        "attention_mask": torch.ones(3, 6, dtype=torch.long),
    }
    params = [
        n for n, _ in model.named_parameters() if n.startswith(("pre_classifier", "classifier"))
    ]
    feats = network_features(model, train, params)
    noise = softmax_hessian(network_logits(model, train).double(), jitter=1e-3)
    z = posterior_samples(
        feats,
        noise,
        Prior(1.0),
        4,
        method="cg",
        generator=torch.Generator().manual_seed(0),
        tol=1e-5,
    ).samples
    samples = linearised_logit_samples(model, test, params, z)
    assert samples.shape == (4, 3, 3)
    assert bool(torch.isfinite(samples).all())
    assert float(samples.std(0).min()) > 0


def test_linearised_targets_make_the_map_the_linear_posterior_mean():
    # At a MAP of the summed cross-entropy + α/2 ‖θ‖², Φᵀ(y − p) = αθ*, so θ̄ of the linear model = θ*.
    model = mlp(2, 4, 3, 0, "cpu")
    g = torch.Generator().manual_seed(2)
    x = torch.randn(30, 2, generator=g, dtype=F64)
    labels = torch.randint(0, 3, (30,), generator=g)
    alpha = 0.5
    opt = torch.optim.LBFGS(
        model.parameters(),
        lr=1,
        max_iter=500,
        tolerance_grad=1e-12,
        tolerance_change=0,
        line_search_fn="strong_wolfe",
    )

    def closure():
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), labels, reduction="sum")
        loss = loss + 0.5 * alpha * sum((p**2).sum() for p in model.parameters())
        loss.backward()
        return loss

    for _ in range(5):
        opt.step(closure)
    params = [n for n, _ in model.named_parameters()]
    feats = network_features(model, x, params)
    logits = network_logits(model, x)
    noise = softmax_hessian(logits, jitter=1e-3)
    theta = network_parameters(model, params)
    targets = linearised_targets(feats, theta, logits, labels, noise)
    mean = posterior_mean(feats, targets, noise, Prior(alpha), tol=1e-10).mean
    torch.testing.assert_close(mean, theta, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 3\); got values in"):
        linearised_targets(feats, theta, logits, labels + 3, noise)


@pytest.mark.slow
def test_howto_example_runs():
    import runpy
    from pathlib import Path

    script = Path(__file__).parents[1] / "examples" / "linearised_laplace_transformer.py"
    ns = runpy.run_path(str(script))
    assert ns["logit_samples"].shape == (16, 8, 2)
    assert bool(torch.isfinite(ns["probs"]).all())


def test_a_subset_gives_the_features_of_its_masks():
    model = mlp(3, 4, 2, 0, "cpu")
    masks = choose(model, "masks", 1)
    subset = Subset.from_model(model, {n: MaskBlock(m.cpu()) for n, m in masks.items()})
    x = torch.randn(5, 3, dtype=F64)
    via_subset = network_features(model, x, subset)
    via_masks = network_features(model, x, masks)
    z = torch.randn(via_masks.d, 3, dtype=F64)
    idx = torch.arange(5)
    torch.testing.assert_close(via_subset.apply(idx, z), via_masks.apply(idx, z))
    torch.testing.assert_close(network_parameters(model, subset), network_parameters(model, masks))

    class FakeSubset:  # duck-typed stand-ins are refused: pass a Subset, names or masks
        names = tuple(masks)

        def mask(self, name):
            return masks[name].cpu()

    with pytest.raises(TypeError, match=r"partialbayes.selection.Subset, got FakeSubset"):
        network_features(model, x, FakeSubset())
