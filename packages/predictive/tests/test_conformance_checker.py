"""check_posterior accepts a correct toy family and catches each broken rule."""

import json
from contextlib import contextmanager

import pytest
import torch
from torch import nn

from partialbayes.predictive import average_softmax, sampled_logits
from partialbayes.predictive.internal import resolve_link, rows
from partialbayes.predictive.testing import check_posterior

from ._refs import BiasSubset


class DiagBias:
    """A diagonal Gaussian over a Linear's bias."""

    links = ("mc",)

    def __init__(self, model, std=0.5, *, restore_on_error=True, check=True):
        self.model = model
        self.check = check
        self.subset = BiasSubset(model.bias.numel())
        self.map = model.bias.detach().clone()
        self.std = std
        self.restore_on_error = restore_on_error

    @property
    def num_floats(self):
        return self.map.numel()

    def sample(self, n=1, *, generator=None):
        eps = torch.randn(n, self.map.numel(), generator=generator)
        return {"bias": self.map + self.std * eps}

    @contextmanager
    def swapped(self, sample):
        if self.check:
            sample = self.subset.check_values(sample)
        with torch.no_grad():
            self.model.bias.copy_(sample["bias"])
        if self.restore_on_error:
            try:
                yield self.model
            finally:
                with torch.no_grad():
                    self.model.bias.copy_(self.map)
        else:
            yield self.model
            with torch.no_grad():
                self.model.bias.copy_(self.map)

    @contextmanager
    def sampled(self, *, generator=None):
        with self.swapped(rows(self.sample(1, generator=generator), 0)) as m:
            yield m

    def predictive_samples(self, batch, n, *, generator=None, target_ids=None):
        return sampled_logits(self, batch, n, generator=generator, target_ids=target_ids)

    def predict(self, batch, *, link=None, n_samples=100, generator=None, target_ids=None):
        resolve_link(link, self.links, "DiagBias")
        draws = self.predictive_samples(
            batch, n_samples, generator=generator, target_ids=target_ids
        )
        return average_softmax(draws)

    def save(self, path):
        with open(path, "w") as f:
            json.dump({"std": self.std}, f)

    @classmethod
    def load(cls, path, model):
        with open(path) as f:
            return cls(model, json.load(f)["std"])


def _toy():
    torch.manual_seed(0)
    return nn.Linear(3, 4), (torch.randn(5, 3), torch.tensor([0, 1, 2, 3, 0]))


def test_a_correct_family_passes(tmp_path):
    model, batch = _toy()
    check_posterior(DiagBias(model), batch, tmp_path / "p.json")


def test_a_family_that_does_not_restore_on_error_fails(tmp_path):
    model, batch = _toy()
    with pytest.raises(AssertionError, match="after an error inside swapped"):
        check_posterior(DiagBias(model, restore_on_error=False), batch, tmp_path / "p.json")


def test_a_family_that_swaps_in_nan_samples_fails(tmp_path):
    model, batch = _toy()
    with pytest.raises(AssertionError, match="must refuse a sample with NaN entries"):
        check_posterior(DiagBias(model, check=False), batch, tmp_path / "p.json")


def test_a_family_whose_load_changes_predictions_fails(tmp_path):
    class Lossy(DiagBias):
        def save(self, path):
            with open(path, "w") as f:
                json.dump({"std": self.std * 2}, f)

    model, batch = _toy()
    with pytest.raises(AssertionError, match="changed after save -> load"):
        check_posterior(Lossy(model), batch, tmp_path / "p.json")


def test_a_family_with_the_wrong_sample_layout_fails(tmp_path):
    class Flat(DiagBias):
        def sample(self, n=1, *, generator=None):
            return {"bias": super().sample(n, generator=generator)["bias"].T}

    model, batch = _toy()
    with pytest.raises(AssertionError, match=r"expected \[n, k\]"):
        check_posterior(Flat(model), batch, tmp_path / "p.json")


def test_a_non_posterior_is_named(tmp_path):
    _model, batch = _toy()
    with pytest.raises(AssertionError, match="missing"):
        check_posterior(object(), batch, tmp_path / "p.json")


def test_a_family_that_ignores_target_ids_fails(tmp_path):
    class Whole(DiagBias):
        def predict(self, batch, *, link=None, n_samples=100, generator=None, target_ids=None):
            return super().predict(batch, link=link, n_samples=n_samples, generator=generator)

    model, batch = _toy()
    with pytest.raises(AssertionError, match=r"target_ids=\[3, 0\] must give \[P, K\]"):
        check_posterior(Whole(model), batch, tmp_path / "p.json")


def test_a_family_that_sorts_target_ids_fails(tmp_path):
    class Sorted(DiagBias):
        def predict(self, batch, *, target_ids=None, **kw):
            ids = None if target_ids is None else sorted(target_ids)
            return super().predict(batch, target_ids=ids, **kw)

    model, batch = _toy()
    with pytest.raises(AssertionError, match="renormalise over the ids, in their order"):
        check_posterior(Sorted(model), batch, tmp_path / "p.json")
