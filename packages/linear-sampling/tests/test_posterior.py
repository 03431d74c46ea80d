"""SampledLaplace: the sampling-based linearised Laplace over a Subset, as a partialbayes Posterior."""

import pytest
import torch
from torch import nn

from partialbayes.linear_sampling import Prior, SampledLaplace
from partialbayes.predictive import Posterior, average_softmax, probit
from partialbayes.predictive.testing import check_posterior
from partialbayes.selection import KronBlock, MaskBlock, Subset

F64 = torch.float64


def mlp(n_out=3, seed=0, device="cpu"):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, n_out)).to(device, F64).eval()


def mlp_subset(model):
    mask = torch.zeros(5, 3, dtype=torch.bool)
    mask[0, 1] = mask[2, 0] = mask[2, 2] = mask[4, 1] = True
    return Subset.from_model(
        model,
        {
            "0.weight": MaskBlock(mask),
            "2.weight": KronBlock(
                rows=torch.tensor([0, 2]) if model[2].out_features > 2 else None,
                cols=torch.tensor([1, 3, 4]),
            ),
            "2.bias": KronBlock(),
        },
    )


def pairs(n_batches=3, batch=7, regression=False, n_out=3, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n_batches):
        x = torch.randn(batch, 3, generator=g, dtype=F64)
        y = (
            torch.randn(batch, generator=g, dtype=F64)
            if regression
            else torch.randint(0, n_out, (batch,), generator=g)
        )
        out.append((x.to(device), y.to(device)))
    return out


def dense_jacobian(model, x, subset):
    """[n, m, d] Jacobian of the logits in the subset's entries (Subset.gather order), by autograd."""
    named = dict(model.named_parameters())
    theta = torch.cat([subset.gather(n, named[n].detach()) for n in subset.names])
    sizes = [subset.num_entries(n) for n in subset.names]

    def f(flat):
        p = {
            n: subset.scatter(n, chunk, named[n].detach())
            for n, chunk in zip(subset.names, flat.split(sizes), strict=True)
        }
        return torch.func.functional_call(model, p, (x,))

    return torch.autograd.functional.jacobian(f, theta)


def dense_posterior_cov(model, subset, x_train, x_test, alpha, jitter):
    j = dense_jacobian(model, x_train, subset)
    with torch.no_grad():
        p = model(x_train).softmax(-1)
    eye = torch.eye(p.shape[1], dtype=F64, device=p.device)
    b = torch.diag_embed(p) - p.unsqueeze(2) * p.unsqueeze(1) + jitter * eye
    h = torch.einsum("nmd,nmk,nke->de", j, b, j) + alpha * torch.eye(
        j.shape[2], dtype=F64, device=p.device
    )
    js = dense_jacobian(model, x_test, subset)
    return js, torch.einsum("nmd,de,nke->nmk", js, torch.linalg.inv(h), js)


def test_predictive_covariance_matches_dense_ggn_laplace(device):
    model = mlp(device=device)
    subset = mlp_subset(model)
    data = pairs(device=device)  # three batches: the loader's features stack them
    x_train = torch.cat([x for x, _ in data])
    x_test = torch.randn(4, 3, dtype=F64, device=device)
    k = 3000
    post = SampledLaplace(model, subset, prior_precision=0.7, jitter=1e-4).fit(
        data, n_samples=k, tol=1e-9, generator=torch.Generator().manual_seed(0)
    )
    assert post.samples.shape == (subset.num_entries(), k)
    assert post.info.converged
    js, cov_ref = dense_posterior_cov(model, subset, x_train, x_test, 0.7, 1e-4)
    f, cov = post.logit_mean_cov(x_test)
    with torch.no_grad():
        torch.testing.assert_close(f, model(x_test))
    var = cov_ref.diagonal(dim1=1, dim2=2)
    se = ((var.unsqueeze(2) * var.unsqueeze(1) + cov_ref**2) / k).sqrt()
    assert bool(((cov - cov_ref).abs() <= 5 * se).all())
    assert bool(((cov - cov_ref).abs() > 0.1 * se).any())  # a sample estimate, not the exact matrix
    # the links: probit on the sample variances; mc over the linearised samples f + J z_j
    torch.testing.assert_close(
        post.predict(x_test, link="probit"), probit(f, cov.diagonal(dim1=-2, dim2=-1))
    )
    lin = f.unsqueeze(0) + torch.einsum("nmd,dk->knm", js, post.samples)
    torch.testing.assert_close(post.predict(x_test, n_samples=k), average_softmax(lin))
    g = torch.Generator(device).manual_seed(1)
    few = post.predictive_samples(x_test, 5, generator=g)
    cols = torch.randperm(k, generator=torch.Generator(device).manual_seed(1), device=device)[:5]
    torch.testing.assert_close(few, lin[cols.cpu()])


@pytest.mark.parametrize("kind", ["classification", "regression", "tokens"])
def test_sampled_laplace_conforms(device, tmp_path, kind):
    if kind == "tokens":
        transformers = pytest.importorskip("transformers")
        from tiny_models import tiny_model

        model = tiny_model("bert", "token", seed=0, intermediate=16, num_labels=3)
        model = model.to(device).eval()
        q = "bert.encoder.layer.0.attention.self.query"
        subset = Subset.from_model(model, {
            f"{q}.weight": KronBlock(rows=torch.tensor([1, 4]), cols=torch.tensor([0, 2, 7])),
            "classifier.weight": KronBlock(), "classifier.bias": KronBlock()})  # fmt: skip
        g = torch.Generator().manual_seed(0)
        data = []
        for length in (6, 8):  # padded to different lengths per batch, as a collator does
            mask = torch.ones(3, length, dtype=torch.long)
            mask[1, length - 2 :] = 0
            labels = torch.randint(0, 3, (3, length), generator=g)
            labels[mask == 0] = -100
            enc = {"input_ids": torch.randint(1, 30, (3, length), generator=g),
                   "attention_mask": mask, "labels": labels}  # fmt: skip
            data.append(transformers.BatchEncoding({k: v.to(device) for k, v in enc.items()}))
        regression = False
    else:
        regression = kind == "regression"
        model = mlp(n_out=1 if regression else 3, device=device)
        subset = mlp_subset(model)
        data = pairs(regression=regression, device=device)
    post = SampledLaplace(
        model, subset, likelihood="regression" if regression else "classification",
        sigma_noise=0.3, prior_precision=2.0,
    ).fit(data, n_samples=12, tol=1e-10, generator=torch.Generator().manual_seed(0))  # fmt: skip
    assert isinstance(post, Posterior)
    check_posterior(post, data[0], tmp_path / "ls.safetensors", regression=regression)
    loaded = SampledLaplace.load(tmp_path / "ls.safetensors", model)
    assert torch.equal(loaded.samples, post.samples)
    assert loaded.sigma_noise == 0.3
    assert loaded.likelihood == post.likelihood


def test_regression_variance_is_the_sample_variance_plus_noise():
    model = mlp(n_out=1)
    subset = mlp_subset(model)
    data = pairs(regression=True)
    post = SampledLaplace(model, subset, likelihood="regression", sigma_noise=0.5).fit(
        data, n_samples=40, tol=1e-12, generator=torch.Generator().manual_seed(0)
    )
    x = data[0][0]
    mean, var = post.predict(x, link="probit")
    f, cov = post.logit_mean_cov(x)
    torch.testing.assert_close(mean, f)
    torch.testing.assert_close(var, cov.diagonal(dim1=-2, dim2=-1) + 0.25)
    # the regression posterior: H = JᵀJ/σ² + A
    j = dense_jacobian(model, torch.cat([x for x, _ in data]), subset)[:, 0]
    h = j.T @ j / 0.25 + torch.eye(j.shape[1], dtype=F64)
    js = dense_jacobian(model, x, subset)[:, 0]
    ref = (js @ torch.linalg.inv(h) * js).sum(-1)
    k = 40
    assert bool(((var[:, 0] - 0.25 - ref).abs() <= 5 * ref * (2 / k) ** 0.5).all())


def test_sample_returns_distinct_stored_samples_and_refuses_more():
    model = mlp()
    subset = mlp_subset(model)
    post = SampledLaplace(model, subset).fit(pairs(), n_samples=6, tol=1e-10)
    theta = torch.cat([subset.gather(n, dict(model.named_parameters())[n].detach())
                       for n in subset.names])  # fmt: skip
    draws = post.sample(6, generator=torch.Generator().manual_seed(3))
    flat = torch.cat([draws[n] for n in subset.names], dim=1)  # [6, d]
    cols = torch.randperm(6, generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(flat, (theta.unsqueeze(1) + post.samples[:, cols]).T)
    assert post.num_floats == 6 * subset.num_entries()
    with pytest.raises(ValueError, match="only k=6 posterior samples are stored"):
        post.sample(7)
    with pytest.raises(ValueError, match="fit with n_samples >= 9"):
        post.predictive_samples(pairs()[0], 9)
    # predict with more samples than stored uses all k of them
    x = pairs()[0][0]
    torch.testing.assert_close(post.predict(x, n_samples=100), post.predict(x, n_samples=6))


def test_save_load_refuses_other_models_and_files(tmp_path):
    model = mlp()
    subset = mlp_subset(model)
    post = SampledLaplace(model, subset).fit(pairs(), n_samples=4, tol=1e-10)
    path = tmp_path / "ls.safetensors"
    post.save(path)
    with pytest.raises(ValueError, match=r"does not match the posterior saved in .*0\.weight"):
        SampledLaplace.load(path, nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)))
    with pytest.raises(ValueError, match=r"missing parameters \['2.bias', '2.weight'\]"):
        SampledLaplace.load(path, nn.Sequential(nn.Linear(3, 5)))
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(1)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(ValueError, match="not a saved partialbayes posterior"):
        SampledLaplace.load(tmp_path / "other.safetensors", model)
    moved = mlp(seed=1)
    for load in (SampledLaplace.load,):  # issue 34: was only a warning
        with pytest.raises(ValueError, match=r"differ from the saved MAP .* check_weights=False"):
            load(path, moved)
        assert torch.equal(load(path, moved, check_weights=False).samples, post.samples)
    grouped = SampledLaplace(
        model,
        subset,
        prior_precision=Prior(torch.tensor([1.0, 3.0]), torch.arange(subset.num_entries()) % 2),
    ).fit(pairs(), n_samples=3, tol=1e-10)
    grouped.save(path)
    back = SampledLaplace.load(path, model)
    assert torch.equal(back.prior.groups, grouped.prior.groups)
    assert torch.equal(back.prior.alpha, grouped.prior.alpha)


def test_bad_input_is_named():
    model = mlp()
    subset = mlp_subset(model)
    post = SampledLaplace(model, subset)
    with pytest.raises(ValueError, match="not fitted"):
        post.sample()
    with pytest.raises(ValueError, match="not fitted"):
        post.save("never.safetensors")
    with pytest.raises(TypeError, match=r"partialbayes\.selection\.Subset"):
        SampledLaplace(model, ["0.weight"])
    with pytest.raises(ValueError, match=r"'0.weight' is shape \(5, 4\), the subset was built for"):
        SampledLaplace(nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)), subset)
    with pytest.raises(ValueError, match="likelihood"):
        SampledLaplace(model, subset, likelihood="poisson")
    with pytest.raises(ValueError, match="prior_precision"):
        SampledLaplace(model, subset, prior_precision=-1.0)
    with pytest.raises(ValueError, match="batches is empty"):
        post.fit([])
    post.fit(pairs(), n_samples=2, tol=1e-8)
    with pytest.raises(ValueError, match=r"SampledLaplace offers \('mc', 'probit'\)"):
        post.predict(pairs()[0], link="bridge")
    model.train()
    post.fit(pairs(), n_samples=2, tol=1e-8)  # fit runs in eval mode and restores the mode
    assert model.training
    with pytest.warns(RuntimeWarning, match="cg solver stopped after 1 steps"):
        post.fit(pairs(), n_samples=2, tol=1e-12, max_iter=1)
    assert not post.info.converged
