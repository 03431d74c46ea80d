"""Bad input to the public entry points gets a ValueError / TypeError naming the argument (issue #16)."""

import contextlib
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from partialbayes.predictive import (
    accuracy,
    apply_temperature,
    brier,
    decompose_classification,
    decompose_regression,
    ece,
    entropy,
    fit_temperature,
    gaussian_nll,
    gaussian_predictive,
    laplace_bridge,
    mc_predict,
    mc_predictive,
    mce,
    nll,
    probit,
    probit_binary,
    reliability,
    sample_logits,
)
from partialbayes.predictive.internal import batch_size, probit_scale

F64 = torch.float64
NON_FINITE = st.sampled_from([math.nan, math.inf, -math.inf])


def prob_rows():
    """Categorical probability vectors (rows of a [N, C] tensor)."""

    @st.composite
    def rows(draw):
        c = draw(st.integers(1, 6))
        n = draw(st.integers(1, 4))
        w = draw(
            st.lists(st.floats(0.0, 10.0), min_size=n * c, max_size=n * c).filter(
                lambda v: all(sum(v[i * c : (i + 1) * c]) > 0 for i in range(n))
            )
        )
        t = torch.tensor(w, dtype=F64).reshape(n, c)
        return t / t.sum(-1, keepdim=True)

    return rows()


# --- the defects -------------------------------------------------------------------------


@given(
    c=st.integers(2, 5),
    i=st.integers(0, 4),
    j=st.integers(0, 4),
    delta=st.floats(1e-2, 10.0),
    batch=st.integers(1, 3),
)
def test_probit_refuses_an_asymmetric_covariance(c, i, j, delta, batch):
    # Its docstring always said so; before the fix only the diagonal was read and checked.
    i, j = i % c, j % c
    if i == j:
        j = (i + 1) % c
    cov = torch.eye(c, dtype=F64).repeat(batch, 1, 1)
    cov[-1, i, j] += delta
    with pytest.raises(ValueError, match="cov must be symmetric"):
        probit(torch.zeros(batch, c, dtype=F64), cov)
    cov[-1, j, i] += delta  # symmetric again: accepted, and only the diagonal matters
    torch.testing.assert_close(
        probit(torch.zeros(batch, c, dtype=F64), cov),
        probit(torch.zeros(batch, c, dtype=F64), cov.diagonal(dim1=-2, dim2=-1)),
    )


@given(off=NON_FINITE)
def test_probit_refuses_non_finite_off_diagonal_covariances(off):
    cov = torch.eye(2, dtype=F64).unsqueeze(0).clone()
    cov[0, 0, 1] = cov[0, 1, 0] = off
    with pytest.raises(ValueError, match="cov contains 2 NaN or infinite"):
        probit(torch.zeros(1, 2, dtype=F64), cov)


@given(probs=prob_rows())
def test_entropy_of_probabilities_is_refused(probs):
    # Before the fix, entropy(probs) returned a (negative) number.
    with pytest.raises(ValueError, match=r"log_probs must be normalised.*pass probs\.log\(\)"):
        entropy(probs)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        with pytest.raises(ValueError, match="log_probs must be normalised"):
            entropy(probs.to(dtype))


@given(probs=prob_rows())
def test_entropy_of_log_probabilities_is_accepted(probs):
    h = entropy(probs.log())
    assert bool((h >= -1e-12).all())
    assert bool((h <= math.log(probs.shape[-1]) + 1e-9).all())
    h32 = entropy(torch.log_softmax(torch.randn(4, 7), -1))  # float32 round-off is accepted
    assert h32.shape == (4,)


def test_entropy_other_bad_inputs():
    with pytest.raises(ValueError, match="normalised log-probabilities"):
        entropy(torch.log(torch.tensor([[0.2, 0.2]])))  # unnormalised, negative: no hint
    with pytest.raises(ValueError, match=r"dim must lie in \[-2, 2\), got 2"):
        entropy(torch.zeros(2, 1), dim=2)
    with pytest.raises(TypeError, match="dim must be an int"):
        entropy(torch.zeros(2, 1), dim=True)
    with pytest.raises(TypeError, match="log_probs must be a floating-point"):
        entropy(torch.zeros(2, 1, dtype=torch.long))


@pytest.mark.parametrize(
    ("temperature", "error"),
    [
        (math.inf, ValueError),
        (0.0, ValueError),
        (-1.0, ValueError),
        (math.nan, ValueError),
        (-math.inf, ValueError),
        (torch.tensor(math.inf), ValueError),
        (torch.tensor([1.0, 2.0]), TypeError),
        (True, TypeError),
        ("2", TypeError),
    ],
    ids=repr,
)
def test_apply_temperature_refuses_bad_temperatures(temperature, error):
    # Before the fix, T = inf returned all-zero logits.
    with pytest.raises(error, match="temperature"):
        apply_temperature(torch.randn(3, 2), temperature)


def test_apply_temperature_accepts_numbers_and_scalar_tensors():
    z = torch.randn(3, 2)
    torch.testing.assert_close(apply_temperature(z, 2), z / 2)
    torch.testing.assert_close(apply_temperature(z, torch.tensor([2.0])), z / 2)


def test_fit_temperature_bad_options():
    z = torch.randn(10, 3, generator=torch.Generator().manual_seed(0))
    y = torch.arange(10) % 3
    for init in (math.inf, math.nan, 0.0, -2.0):
        with pytest.raises(ValueError, match="init must be a finite number > 0"):
            fit_temperature(z, y, init=init)
    with pytest.raises(TypeError, match="init must be a number"):
        fit_temperature(z, y, init=True)
    for max_iter in (0, True, 2.5):
        with pytest.raises(ValueError if max_iter == 0 else TypeError, match="max_iter"):
            fit_temperature(z, y, max_iter=max_iter)


# --- generated NaN / inf everywhere ----------------------------------------------------------------


@pytest.mark.parametrize("fn", [accuracy, nll, brier, ece, mce, reliability])
@given(bad=NON_FINITE, row=st.integers(0, 2), col=st.integers(0, 1))
def test_metrics_refuse_non_finite_probabilities(fn, bad, row, col):
    p = torch.full((3, 2), 0.5)
    p[row, col] = bad
    with pytest.raises(ValueError, match="probs contains 1 NaN or infinite"):
        fn(p, torch.tensor([0, 1, 0]))


@pytest.mark.parametrize("fn", [probit, laplace_bridge, mc_predictive, sample_logits])
@given(bad=NON_FINITE, where=st.sampled_from(["mean", "var", "cov"]))
def test_gaussian_links_refuse_non_finite_moments(fn, bad, where):
    mean, var = torch.zeros(2, 3, dtype=F64), torch.ones(2, 3, dtype=F64)
    cov = torch.eye(3, dtype=F64).repeat(2, 1, 1)
    {"mean": mean, "var": var, "cov": cov}[where].view(-1)[1] = bad
    args = (mean, cov if where == "cov" else var)
    extra = (2,) if fn in (mc_predictive, sample_logits) else ()
    with pytest.raises(ValueError, match=f"{'mean' if where == 'mean' else 'cov'} contains"):
        fn(*args, *extra)


@given(bad=NON_FINITE)
def test_regression_pieces_refuse_non_finite_values(bad):
    x = torch.tensor([0.0, bad])
    with pytest.raises(ValueError, match="var"):
        probit_scale(x)
    with pytest.raises(ValueError, match="var"):
        probit_binary(torch.zeros(2), x)
    with pytest.raises(ValueError, match="noise_var"):
        gaussian_predictive(torch.zeros(2), torch.ones(2), x)
    with pytest.raises(ValueError, match="targets"):
        gaussian_nll(torch.zeros(2), 1.0, x)
    with pytest.raises(ValueError, match="mean_samples"):
        decompose_regression(torch.stack([x, x]))
    with pytest.raises(ValueError, match="logit_samples"):
        decompose_classification(torch.stack([x, x]).unsqueeze(0))


def test_negative_variances_and_other_values():
    with pytest.raises(ValueError, match="var must be non-negative"):
        probit_scale(torch.tensor([-1.0]))
    with pytest.raises(TypeError, match="noise_var must be a number"):
        gaussian_predictive(torch.zeros(2), torch.ones(2), "0.1")


# --- counts, generators, callables, batches ------------------------------------------------------


@pytest.mark.parametrize("n", [0, -1, True, 2.5, "4"])
def test_sample_counts(n):
    mean, var = torch.zeros(1, 2), torch.ones(1, 2)
    error = TypeError if isinstance(n, bool) or not isinstance(n, int) else ValueError
    for fn in (mc_predictive, sample_logits):
        with pytest.raises(error, match="n_samples must be"):
            fn(mean, var, n)
    with pytest.raises(error, match="n_samples must be"):
        mc_predict(lambda s: contextlib.nullcontext(), lambda: torch.zeros(1, 2), n)


@pytest.mark.parametrize("generator", [0, "seed", torch.Generator().manual_seed(0).get_state()])
def test_generators_are_type_checked(generator):
    for fn in (mc_predictive, sample_logits):
        with pytest.raises(TypeError, match=r"generator must be a torch\.Generator"):
            fn(torch.zeros(1, 2), torch.ones(1, 2), 3, generator=generator)


def test_mc_predict_bad_callables_and_outputs():
    with pytest.raises(TypeError, match="callable"):
        mc_predict(None, lambda: torch.zeros(1, 2), 2)
    with pytest.raises(ValueError, match=r"forward\(\) output \(sample 0\) contains"):
        mc_predict(lambda s: contextlib.nullcontext(), lambda: torch.full((1, 2), math.nan), 2)


@pytest.mark.parametrize("inputs", [3, None, [torch.zeros(2)], "text"], ids=repr)
def test_batch_size_of_unsupported_inputs(inputs):
    with pytest.raises(TypeError, match="inputs must be a tensor or a mapping"):
        batch_size(inputs)


@pytest.mark.parametrize(
    ("likelihood", "sigma", "match"),
    [
        ("poisson", 1.0, "likelihood must be one of"),
        ("regression", 0.0, "sigma_noise must be a finite number > 0"),
        ("regression", float("nan"), "sigma_noise"),
        ("regression", True, "sigma_noise must be a number"),
        ("regression", "1", "sigma_noise must be a number"),
    ],
)
def test_check_likelihood_names_the_option(likelihood, sigma, match):
    from partialbayes.predictive.internal import check_likelihood

    with pytest.raises(TypeError if "must be a number" in match else ValueError, match=match):
        check_likelihood(likelihood, sigma)


def test_check_likelihood_returns_a_float():
    from partialbayes.predictive.internal import check_likelihood

    assert check_likelihood("regression", 2) == 2.0
    assert isinstance(check_likelihood("classification"), float)


def test_shared_checkers_name_the_culprit_and_keep_the_kind():
    """Issue 33: the checkers the sibling packages share instead of hand-written raises."""
    from partialbayes.predictive import internal as pi

    with pytest.raises(ValueError, match=r"^sd has no 'b' and has unknown entries \['x'\]$"):
        pi.check_keys("sd", {"a": 1, "x": 2}, ("a", "b"), ())
    with pytest.raises(ValueError, match=r"unknown state entries \['x'\]"):
        pi.check_keys("it", {"a": 1, "x": 2}, ("a",), (), "state entries")
    pi.check_keys("sd", {"a": 1, "x": 2}, ("a",))  # allowed=None: extra keys pass
    with pytest.raises(ValueError, match=r"^unknown task 'c'; valid tasks: a, b$"):
        pi.check_known("task", "c", ("a", "b"))
    with pytest.raises(ValueError, match=r"^unknown method\(s\) \['c'\]; valid: a, b$"):
        pi.check_known("method(s)", ["a", "c"], ("a", "b"), "valid")
    pi.check_known("task", ["a", "b"], ("a", "b"))
    shapes = {"w": torch.Size([2])}
    with pytest.raises(ValueError, match=r"^m: parameter 'w' has shape \(3,\) in A, \(2,\) in B$"):
        pi.check_shapes("m: ", {"w": torch.zeros(3)}, shapes, "A", "B")
    with pytest.raises(ValueError, match=r"parameter 'w' is missing from A, \(2,\) in B"):
        pi.check_shapes("", {}, shapes, "A", "B")
    pi.check_shapes("", {"w": torch.zeros(2), "v": torch.zeros(1)}, shapes, "A", "B")
    for bad in (torch.tensor([1.0, math.inf]), math.nan):
        with pytest.raises(ValueError, match=r"^boom$"):
            pi.check_finite(bad, "boom")
    pi.check_finite(torch.tensor([1.0, -2.0]), "boom")
    for err, match in ((TypeError("t"), r"^batch 3: t$"), (ValueError("v"), r"^batch 3: v$")):
        with pytest.raises(type(err), match=match), pi.prefixed("batch 3"):
            raise err
    with (
        pytest.raises(IndexError, match=r"^i$"),
        pi.prefixed("batch 3"),
    ):  # other kinds pass as they are
        raise IndexError("i")
    with pytest.raises(TypeError, match=r"^b must be a floating tensor, got dtype torch.int64$"):
        pi.check_tensor("b", torch.zeros(2, dtype=torch.long), what="a floating tensor")
    with pytest.raises(TypeError, match=r"^n must be an int, got bool True$"):
        pi.check_int("n", True)
    assert pi.check_bool("flag", False) is False
    # NumPy's scalars count (n_data = mask.sum() is one), as Python ints and floats
    np = pytest.importorskip("numpy")
    assert type(pi.check_int("n", np.int64(3))) is int
    assert pi.check_int("n", np.int32(2)) == 2
    assert type(pi.check_number("x", np.float32(0.5))) is float
    with pytest.raises(ValueError, match=r"^n must be a positive int, got 0$"):
        pi.check_int("n", np.int64(0))
    with pytest.raises(TypeError, match=r"^n must be an int, got bool"):
        pi.check_int("n", np.bool_(True))
