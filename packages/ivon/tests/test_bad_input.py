import math

import pytest
import torch

from partialbayes.ivon import IVON


def _params():
    return [torch.nn.Parameter(torch.zeros(3))]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"ess": 0.0}, "ess"),
        ({"ess": -1.0}, "ess"),
        ({"lr": 0.0}, "lr"),
        ({"lr": -0.1}, "lr"),
        ({"hess_init": 0.0}, "hess_init"),
        ({"beta1": 1.0}, "beta1"),
        ({"beta1": -0.1}, "beta1"),
        ({"beta2": 1.0}, "beta2"),
        ({"beta2": 1.5}, "beta2"),
        ({"weight_decay": -1e-4}, "weight_decay"),
        ({"clip_radius": 0.0}, "clip_radius"),
        ({"lr": math.nan}, "lr"),
        ({"hess_approx": "ggn"}, "hess_approx"),
        ({"mc_samples": 0}, "mc_samples"),
        ({"mc_samples": 1.5}, "mc_samples"),
    ],
)
def test_bad_hyperparameters(kwargs, match):
    args = {"lr": 0.1, "ess": 10.0, **kwargs}
    with pytest.raises(ValueError, match=match):
        IVON(_params(), **args)


def test_bad_types():
    with pytest.raises(TypeError, match="lr"):
        IVON(_params(), lr="0.1", ess=10)
    with pytest.raises(TypeError, match="generator"):
        IVON(_params(), lr=0.1, ess=10, generator=0)
    with pytest.raises(TypeError, match="floating point"):
        IVON([torch.zeros(3, dtype=torch.long)], lr=0.1, ess=10)


def test_bad_param_group_override():
    with pytest.raises(ValueError, match="beta2"):
        IVON([{"params": _params(), "beta2": 1.0}], lr=0.1, ess=10)


def test_step_without_samples_and_inside_context():
    p = _params()
    opt = IVON(p, lr=0.1, ess=10)
    with pytest.raises(RuntimeError, match="sampled_params"):
        opt.step()
    with opt.sampled_params(train=False):
        pass
    with pytest.raises(RuntimeError, match="at least one gradient sample"):
        opt.step()  # train=False collects nothing
    with pytest.raises(RuntimeError, match="inside sampled_params"), opt.sampled_params(train=True):
        opt.step()
    assert torch.equal(p[0].detach(), torch.zeros(3))  # mean restored after the error


def test_nested_sampled_params():
    opt = IVON(_params(), lr=0.1, ess=10)
    with pytest.raises(RuntimeError, match="nested"), opt.sampled_params(), opt.sampled_params():
        pass
    with opt.sampled_params():  # usable again afterwards
        pass


def test_sparse_gradients_rejected():
    emb = torch.nn.Embedding(5, 2, sparse=True)
    opt = IVON(emb.parameters(), lr=0.1, ess=10)
    with pytest.raises(TypeError, match="sparse"), opt.sampled_params(train=True):
        emb(torch.tensor([1])).sum().backward()
