"""End to end on tiny Hugging Face classifiers: fit, tune the prior, predict, sample, save, load."""

import math
import sys
from pathlib import Path

import pytest
import torch

from partialbayes.curvature import DenseLaplace, DiagLaplace, KronLaplace
from partialbayes.selection import last_layer, random_parameters, sparse_kfac
from tiny_models import tiny_model

sys.path.insert(0, str(Path(__file__).parent))
from _laplace_helpers import autograd_block_jacobian, dense_posterior_covariance

VOCAB, CLASSES = 50, 3


def distilbert():
    return tiny_model("distilbert", seed=0, size="s", num_labels=CLASSES).eval()


def bert():
    return tiny_model("bert", seed=0, size="s", num_labels=CLASSES).eval()


def gpt2():
    return tiny_model("gpt2", seed=0, size="s", num_labels=CLASSES, pad_token_id=0).eval()


def batches(n_batches, size, seed, length=10):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n_batches):
        mask = torch.ones(size, length, dtype=torch.long)
        mask[0, length // 2 :] = 0  # a padded sequence (right padding)
        ids = torch.randint(1, VOCAB, (size, length), generator=g) * mask
        labels = torch.randint(0, CLASSES, (size,), generator=g)
        out.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return out


def _inputs(batch):
    return {k: v for k, v in batch.items() if k != "labels"}


@pytest.mark.parametrize("make", [distilbert, bert, gpt2])
def test_kron_end_to_end(make, tmp_path):
    model = make()
    train, val, test = batches(3, 4, 0), batches(1, 4, 1), batches(1, 3, 2)[0]
    subset = sparse_kfac(model, 50)
    la = KronLaplace(model, subset, num_classes=CLASSES).fit(train)
    assert la.n_data == 12
    lml = la.log_marginal_likelihood()
    assert torch.isfinite(lml)
    grid = torch.logspace(-1, 3, 9)
    best = la.optimize_prior_precision("marglik", grid=grid)
    scores = torch.stack([la.log_marginal_likelihood(float(v)) for v in grid])
    assert best == pytest.approx(grid[int(scores.argmax())].item())
    chosen = la.optimize_prior_precision("val_nll", val_loader=val, grid=grid)
    assert chosen in grid.tolist()

    f, cov = la.logit_mean_cov(test)
    assert f.shape == (3, CLASSES)
    assert cov.shape == (3, CLASSES, CLASSES)
    torch.testing.assert_close(f, model(**_inputs(test)).logits.detach())
    torch.testing.assert_close(cov, cov.mT)
    assert (torch.linalg.eigvalsh(cov.double()) > -1e-6).all()
    # the hook Jacobians and autograd Jacobians give the same functional covariance
    J = autograd_block_jacobian(la, _inputs(test)).double()
    ref = J @ dense_posterior_covariance(la) @ J.mT
    torch.testing.assert_close(cov.double(), ref, rtol=1e-4, atol=1e-7)

    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    with la.sampled(generator=torch.Generator().manual_seed(0)) as m:
        sampled_logits = m(**_inputs(test)).logits
    assert not torch.allclose(sampled_logits, f)
    for k, v in model.named_parameters():
        assert torch.equal(v.detach(), before[k])

    path = tmp_path / "kron.safetensors"
    la.save(path)
    fresh = make()
    fresh.load_state_dict(model.state_dict())
    back = KronLaplace.load(path, fresh)
    torch.testing.assert_close(back.logit_mean_cov(test)[1], cov)
    with pytest.raises(ValueError, match="does not match"):
        KronLaplace.load(path, distilbert() if make is not distilbert else bert())


def test_dense_last_layer_and_diag_on_bert():
    model = bert()
    train, test = batches(2, 4, 3), batches(1, 2, 4)[0]
    dense = DenseLaplace(model, last_layer(model)).fit(train)
    f, cov = dense.logit_mean_cov(test)
    assert cov.shape == (2, CLASSES, CLASSES)
    assert math.isfinite(dense.optimize_prior_precision())
    subset = random_parameters(model, 0.5, seed=0)
    diag = DiagLaplace(model, subset).fit(train)
    f2, cov2 = diag.logit_mean_cov(test)
    torch.testing.assert_close(f2, f)
    assert (torch.diagonal(cov2, dim1=-2, dim2=-1) > 0).all()
    assert diag.num_floats == subset.num_entries()
    assert dense.num_floats == dense.subset.num_entries() ** 2 + dense.subset.num_entries()
