"""KFAC / S-KFAC factors against dense float64 references."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from _factor_refs import dense_ef, dense_ggn, linear_block_jacobian
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from partialbayes.curvature import ModuleFactors, diag_curvature, kfac, kfac_many
from partialbayes.selection import KronBlock, MaskBlock, Subset, modules

FIXTURE = settings(
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)


def mlp(d_in: int, h: int, c: int, seed: int, bias: bool = True) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(d_in, h, bias=bias), nn.Tanh(), nn.Linear(h, c, bias=bias)
    ).double()


@given(
    d_in=st.integers(1, 4),
    h=st.integers(1, 5),
    c=st.integers(2, 4),
    seed=st.integers(0, 2**16),
    module=st.sampled_from(["0", "2"]),
    bias=st.booleans(),
    likelihood=st.sampled_from(["classification", "regression"]),
    fisher=st.sampled_from(["exact", "empirical"]),
)
@FIXTURE
def test_one_datum_block_equals_dense(d_in, h, c, seed, module, bias, likelihood, fisher, device):
    model = mlp(d_in, h, c, seed, bias).eval()
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, d_in, generator=g, dtype=torch.float64)
    if likelihood == "classification":
        y = torch.randint(0, c, (1,), generator=g)
    else:
        y = torch.randn(1, c, generator=g, dtype=torch.float64)
    sigma = 0.7
    logits, J = linear_block_jacobian(model, x, module, bias)
    ref = (
        dense_ggn(J, logits, likelihood, sigma)
        if fisher == "exact"
        else dense_ef(J, logits, y, likelihood, sigma)
    )
    model.to(device)
    f = kfac(
        model,
        [(x.to(device), y.to(device))],
        modules(model, [module]),
        likelihood=likelihood,
        fisher=fisher,
        sigma_noise=sigma,
    )[module]
    assert isinstance(f, ModuleFactors)
    assert f.bias is bias
    assert f.n_examples == 1
    assert f.rows is None
    assert f.cols is None
    assert f.G.dtype == torch.float64
    assert f.G.device.type == device.type
    torch.testing.assert_close(torch.kron(f.G, f.A).cpu(), ref, rtol=1e-9, atol=1e-12)


@given(seed=st.integers(0, 2**16), n=st.integers(2, 6), p=st.integers(1, 100))
@FIXTURE
def test_skfac_factors_are_principal_subblocks(seed, n, p, device):
    model = mlp(5, 6, 3, seed).to(device).eval()
    g = torch.Generator().manual_seed(seed)
    rows = torch.randperm(6, generator=g)[: max(1, 6 * p // 100)].sort().values
    cols = torch.randperm(5, generator=g)[: max(1, 5 * p // 100)].sort().values
    x = torch.randn(n, 5, generator=g, dtype=torch.float64).to(device)
    y = torch.randint(0, 3, (n,), generator=g).to(device)
    full = kfac(model, [(x, y)], modules(model, ["0"]), fisher="empirical")["0"]
    sub = Subset.from_model(model, {"0.weight": KronBlock(rows, cols), "0.bias": KronBlock(rows)})
    part = kfac(model, [(x, y)], sub, fisher="empirical")["0"]
    r, c = rows.to(device), torch.cat([cols, torch.tensor([5])]).to(device)
    torch.testing.assert_close(part.G, full.G[r][:, r])
    torch.testing.assert_close(part.A, full.A[c][:, c])
    assert torch.equal(part.rows, rows)
    assert torch.equal(part.cols, cols)
    assert part.bias


@given(seed=st.integers(0, 2**16), split=st.integers(1, 5))
@FIXTURE
def test_batch_size_does_not_change_factors(seed, split, device):
    model = mlp(3, 4, 2, seed).eval().to(device)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(6, 3, generator=g, dtype=torch.float64).to(device)
    y = torch.randint(0, 2, (6,), generator=g).to(device)
    s = modules(model, ["0", "2"])
    one = kfac(model, [(x, y)], s)
    many = kfac(model, [(x[i : i + split], y[i : i + split]) for i in range(0, 6, split)], s)
    for m in one:
        torch.testing.assert_close(one[m].G, many[m].G)
        torch.testing.assert_close(one[m].A, many[m].A)
        assert many[m].n_examples == 6


def test_float32_accumulation(device):
    model = mlp(3, 4, 2, 0).eval().to(device)
    x = torch.randn(5, 3, dtype=torch.float64, device=device)
    y = torch.randint(0, 2, (5,), device=device)
    f64 = kfac(model, [(x, y)], modules(model, ["2"]))["2"]
    f32 = kfac(model, [(x, y)], modules(model, ["2"]), dtype=torch.float32)["2"]
    assert f32.G.dtype == torch.float32
    torch.testing.assert_close(f32.G.double(), f64.G, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- bad input
def test_mask_subset_points_to_diag_dense():
    model = mlp(3, 4, 2, 0)
    s = Subset.from_model(model, {"0.weight": MaskBlock(torch.ones(4, 3, dtype=torch.bool))})
    with pytest.raises(TypeError, match="diag_curvature"):
        kfac(model, [(torch.randn(2, 3, dtype=torch.float64), torch.tensor([0, 1]))], s)


def test_empty_loader_and_bad_options():
    model = mlp(3, 4, 2, 0).eval()
    s = modules(model, ["2"])
    with pytest.raises(ValueError, match="empty"):
        kfac(model, [], s)
    x = torch.randn(2, 3, dtype=torch.float64)
    with pytest.raises(ValueError, match="fisher"):
        kfac(model, [(x, torch.tensor([0, 1]))], s, fisher="bogus")
    with pytest.raises(ValueError, match="sharing"):
        kfac(model, [(x, torch.tensor([0, 1]))], s, sharing="bogus")
    with pytest.raises(ValueError, match="mc_samples"):
        kfac(model, [(x, torch.tensor([0, 1]))], s, fisher="mc", mc_samples=0)


def test_labels_out_of_range_and_num_classes():
    model = mlp(3, 4, 2, 0).eval()
    s = modules(model, ["2"])
    x = torch.randn(2, 3, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 2\)"):
        kfac(model, [(x, torch.tensor([0, 2]))], s, fisher="empirical")
    with pytest.raises(ValueError, match="num_classes=3"):
        kfac(model, [(x, torch.tensor([0, 1]))], s, num_classes=3)


@pytest.mark.parametrize("fisher", ["exact", "mc", "empirical"])
def test_labels_are_checked_whatever_the_fisher(fisher, device):
    """Labels present in a batch are validated even when the fisher type does not use them."""
    model = mlp(3, 4, 2, 0).eval().to(device)
    s = modules(model, ["0", "2"])
    x = torch.randn(4, 3, dtype=torch.float64, device=device)
    good = (x[:2], torch.tensor([0, 1], device=device))

    def run(labels, likelihood="classification"):
        first = (
            good if likelihood == "classification" else (x[:2], torch.zeros(2, 2, device=device))
        )
        return kfac(
            model, [first, (x[2:], labels.to(device))], s, fisher=fisher, likelihood=likelihood
        )

    with pytest.raises(
        ValueError, match=r"batch 1: labels must lie in \[0, 2\); got values in \[0, 2\]"
    ):
        run(torch.tensor([0, 2]))
    with pytest.raises(
        ValueError, match=r"batch 1: labels must lie in \[0, 2\); got values in \[-1"
    ):
        run(torch.tensor([-1, 1]))
    with pytest.raises(TypeError, match="batch 1: labels must be an integer tensor"):
        run(torch.tensor([0.0, 1.0]))
    with pytest.raises(TypeError, match="batch 1: labels must be an integer tensor"):
        run(torch.tensor([True, False]))
    with pytest.raises(ValueError, match=r"batch 1: labels must have shape \[2\]"):
        run(torch.tensor([[0], [1]]))
    with pytest.raises(ValueError, match=r"batch 1: regression targets of shape \(2, 3\)"):
        run(torch.zeros(2, 3), "regression")
    with pytest.raises(ValueError, match="batch 1: regression targets are not finite"):
        run(torch.tensor([[0.0, float("inf")], [0.0, 0.0]]), "regression")
    with pytest.raises(TypeError, match="batch 1: labels must be a tensor"):
        kfac(model, [good, (x[2:], ["a", "b"])], s, fisher=fisher)
    with pytest.raises(TypeError, match=r"batch 1: batch must be .*got set"):
        kfac(model, [good, {1, 2}], s, fisher=fisher)
    # labels given as a list of ints are converted (partialbayes.predictive.internal.split_batch)
    as_list = kfac(
        model, [good, (x[2:], [1, 0])], s, fisher=fisher, generator=torch.Generator().manual_seed(0)
    )
    as_tensor = kfac(
        model,
        [good, (x[2:], torch.tensor([1, 0], device=device))],
        s,
        fisher=fisher,
        generator=torch.Generator().manual_seed(0),
    )
    for m in as_list:
        torch.testing.assert_close(as_list[m].G, as_tensor[m].G)
    # valid int32 labels give the int64 result
    a = kfac(
        model,
        [good, (x[2:], torch.tensor([1, 0], device=device))],
        s,
        fisher=fisher,
        generator=torch.Generator().manual_seed(0),
    )
    b = kfac(
        model,
        [good, (x[2:], torch.tensor([1, 0], device=device).int())],
        s,
        fisher=fisher,
        generator=torch.Generator().manual_seed(0),
    )
    for m in a:
        torch.testing.assert_close(a[m].G, b[m].G, rtol=0, atol=0)


def test_on_batch_sees_logits_and_validated_labels_in_the_single_pass(device):
    model = mlp(3, 4, 2, 0).eval().to(device)
    s = modules(model, ["2"])
    x = torch.randn(5, 3, dtype=torch.float64, device=device)
    y = torch.tensor([0, 1, 1, 0, 1], dtype=torch.int32, device=device)
    seen = []
    batches = ((x[i : i + 2], y[i : i + 2]) for i in range(0, 5, 2))  # a one-shot generator
    kfac(model, batches, s, on_batch=lambda i, f, lab: seen.append((i, f, lab)))
    assert [i for i, _, _ in seen] == [0, 1, 2]
    with torch.no_grad():
        torch.testing.assert_close(torch.cat([f for _, f, _ in seen]), model(x))
    assert all(not f.requires_grad for _, f, _ in seen)
    assert all(lab.dtype == torch.int64 for _, _, lab in seen)
    torch.testing.assert_close(torch.cat([lab for _, _, lab in seen]), y.long())
    seen.clear()
    kfac(model, [x], s, on_batch=lambda i, f, lab: seen.append(lab))
    assert seen == [None]


def test_non_finite_curvature_names_module_and_batch():
    model = mlp(3, 4, 2, 0).eval()
    x = torch.randn(2, 3, dtype=torch.float64)
    bad = x.clone()
    bad[0, 0] = float("inf")
    with torch.no_grad():
        model[2].weight.zero_()  # logits stay finite, inputs of layer 0 are not
    with pytest.raises(ValueError, match=r"module '0' at batch 1"):
        kfac(model, [(x, torch.tensor([0, 1])), (bad, torch.tensor([0, 1]))], modules(model, ["0"]))


def test_training_mode_warns_and_is_restored():
    model = nn.Sequential(nn.Linear(3, 4), nn.Dropout(0.5), nn.Linear(4, 2)).double().train()
    x, y = torch.randn(4, 3, dtype=torch.float64), torch.tensor([0, 1, 0, 1])
    with pytest.warns(UserWarning, match="training mode") as record:
        a = kfac(model, [(x, y)], modules(model, ["0"]))["0"]
    assert record[0].filename == __file__  # the user's call, not a line inside the package
    assert model.training
    for call in (kfac_many, diag_curvature):  # the shared entry pass warns at the same line
        with pytest.warns(UserWarning, match="training mode") as record:
            call(
                model,
                [(x, y)],
                [modules(model, ["0"])] if call is kfac_many else modules(model, ["0"]),
            )
        assert record[0].filename == __file__
    b = kfac(model.eval(), [(x, y)], modules(model, ["0"]))["0"]
    torch.testing.assert_close(a.G, b.G)  # dropout was off


def test_batch_kinds_and_errors():
    sys.path.insert(0, str(Path(__file__).parent))
    from _factor_refs import SeqNet, seq_batch

    model = SeqNet(3, 4, 2).double().eval()
    batch = seq_batch(3, 2, 3, 2, 0)
    s = modules(model, ["lin1"])
    no_labels = {k: v for k, v in batch.items() if k != "labels"}
    a = kfac(model, [no_labels], s, progress=True)["lin1"]  # exact fisher needs no labels
    b = kfac(model, [batch], s)["lin1"]
    torch.testing.assert_close(a.G, b.G)
    with pytest.raises(ValueError, match="needs labels"):
        kfac(model, [no_labels], s, fisher="empirical")
    with pytest.raises(TypeError, match="batch must be"):
        kfac(model, [42], s)
    with pytest.raises(ValueError, match="regression targets"):
        kfac(
            model,
            [{**batch, "labels": torch.zeros(3, 5)}],
            s,
            likelihood="regression",
            fisher="empirical",
        )


def test_module_not_called_is_reported():
    class Skip(nn.Module):
        def __init__(self):
            super().__init__()
            self.used = nn.Linear(3, 2)
            self.unused = nn.Linear(3, 2)

        def forward(self, x):
            return self.used(x)

    model = Skip().double().eval()
    with pytest.raises(ValueError, match="not called"):
        kfac(
            model,
            [(torch.randn(2, 3, dtype=torch.float64), torch.tensor([0, 1]))],
            modules(model, ["unused"]),
        )
