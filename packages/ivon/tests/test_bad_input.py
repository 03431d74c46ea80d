"""Bad input to the optimizer's public entry points: a clear error naming the culprit, and no state changed."""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from partialbayes.ivon import IVON

RANGES = {  # name: (a valid value, out-of-range values)
    "lr": (0.1, [0.0, -0.1, math.inf, -math.inf]),
    "ess": (10.0, [0.0, -1.0, math.inf]),
    "hess_init": (1.0, [0.0, -1e-3, math.inf]),
    "beta1": (0.9, [1.0, -0.1, 1.5, math.inf]),
    "beta2": (0.99, [1.0, -1e-9, 2.0]),
    "weight_decay": (1e-4, [-1e-4, math.inf]),
    "clip_radius": (math.inf, [0.0, -1.0]),
}
NOT_NUMBERS = st.sampled_from(["0.1", None, [0.1], True, torch.tensor(0.1), object()])


def _params():
    return [torch.nn.Parameter(torch.zeros(3))]


def _mlp(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2)
    ).double()


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(6, 3, generator=g, dtype=torch.float64), torch.randn(
        6, 2, generator=g, dtype=torch.float64
    )


def _snapshot(model, opt):
    ps = list(model.parameters())
    return (
        [p.detach().clone() for p in ps]
        + [opt.state[p]["hess"].clone() for p in ps]
        + [opt.state[p]["momentum"].clone() for p in ps]
        + [g["step"] for g in opt.param_groups]
    )


def _same(a, b):
    """Equal states; the means up to the rounding of the samples' round trips m + ε − ε (float64)."""
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        if isinstance(x, torch.Tensor):
            torch.testing.assert_close(x, y, rtol=1e-15, atol=1e-16)
        else:
            assert x == y


def _train_step(model, opt, x, y, scale=1.0):
    with opt.sampled_params(train=True):
        opt.zero_grad()
        (((model(x) - y) ** 2).mean() * scale).backward()
    opt.step()


# ------------------------------------------------------------------------------------------ hyperparameters
@given(name=st.sampled_from(sorted(RANGES)), data=st.data())
def test_out_of_range_hyperparameters_name_themselves(name, data):
    bad = data.draw(st.sampled_from([*RANGES[name][1], math.nan]))
    with pytest.raises(ValueError, match=name):
        IVON(_params(), **{"lr": 0.1, "ess": 10.0, name: bad})
    opt = IVON(_params(), lr=0.1, ess=10.0)
    with pytest.raises(
        ValueError, match=name
    ):  # also as a group override, and nothing stays behind
        opt.add_param_group({"params": _params(), name: bad})
    assert len(opt.param_groups) == 1


@given(name=st.sampled_from(sorted(RANGES)), bad=NOT_NUMBERS)
def test_non_numeric_hyperparameters_are_type_errors(name, bad):
    with pytest.raises(TypeError, match=name):
        IVON(_params(), **{"lr": 0.1, "ess": 10.0, name: bad})


@given(
    kwargs=st.one_of(
        st.fixed_dictionaries({"mc_samples": st.integers(-5, 0)}),
        st.fixed_dictionaries(
            {"hess_approx": st.text(max_size=8).filter(lambda s: s not in ("price", "gradsq"))}
        ),
    )
)
def test_bad_options_are_value_errors(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        IVON(_params(), lr=0.1, ess=10.0, **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"generator": 0}, "generator"),
        ({"compiled": "yes"}, "compiled"),
        ({"compiled": 1}, "compiled"),
        ({"mc_samples": 1.5}, "mc_samples"),
        ({"mc_samples": True}, "mc_samples"),
    ],
)
def test_bad_option_types(kwargs, match):
    with pytest.raises(TypeError, match=match):
        IVON(_params(), lr=0.1, ess=10, **kwargs)


def test_non_floating_parameters():
    with pytest.raises(TypeError, match="floating point"):
        IVON([torch.zeros(3, dtype=torch.long)], lr=0.1, ess=10)


# ----------------------------------------------------------------------------------- sampling and stepping
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


@pytest.mark.parametrize("train", [1, "yes", None])
def test_train_flag_must_be_bool(train):
    opt = IVON(_params(), lr=0.1, ess=10)
    with pytest.raises(TypeError, match="train"), opt.sampled_params(train=train):
        pass


@pytest.mark.parametrize("bad", [0, -1.0, float("inf"), float("nan"), True, "8", torch.tensor(8.0)])
def test_batch_size_must_be_a_positive_number(bad):
    model = _mlp()
    opt = IVON(model.parameters(), lr=0.1, ess=6)
    error = TypeError if isinstance(bad, (bool, str, torch.Tensor)) else ValueError
    with (
        pytest.raises(error, match="batch_size must be"),
        opt.sampled_params(train=True, batch_size=bad),
    ):
        pass
    assert not opt._sampling


def test_closure_must_be_callable():
    opt = IVON(_params(), lr=0.1, ess=10)
    with pytest.raises(TypeError, match="closure"):
        opt.step(closure=0.5)


def test_sparse_gradients_rejected():
    emb = torch.nn.Embedding(5, 2, sparse=True)
    opt = IVON(emb.parameters(), lr=0.1, ess=10)
    with pytest.raises(TypeError, match="sparse"), opt.sampled_params(train=True):
        emb(torch.tensor([1])).sum().backward()


@pytest.mark.parametrize("bad", [math.nan, math.inf])
@pytest.mark.parametrize("mc", [1, 2])
def test_non_finite_gradients_raise_naming_the_parameter_and_leave_the_state(bad, mc):
    """Issue #16: NaN gradients inside sampled_params(train=True) used to write NaN into every mean."""
    model = _mlp()
    x, y = _data()
    opt = IVON(
        model.named_parameters(),
        lr=0.1,
        ess=6,
        mc_samples=mc,
        generator=torch.Generator().manual_seed(0),
    )
    _train_step(model, opt, x, y)
    before = _snapshot(model, opt)
    for _ in range(mc):
        with opt.sampled_params(train=True):
            opt.zero_grad()
            loss = ((model(x) - y) ** 2).mean() + model[2].bias.sum() * bad  # only '2.bias' is hit
            loss.backward()
    with pytest.raises(ValueError, match=r"non-finite gradients.*'2\.bias'") as err:
        opt.step()
    assert "0.weight" not in str(err.value)
    _same(before, _snapshot(model, opt))
    assert all(p.grad is None for p in model.parameters())  # the samples were dropped
    _train_step(model, opt, x, y)  # and the optimizer is usable
    assert opt.current_step == 2
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_non_finite_gradients_through_a_closure():
    model = _mlp()
    x, y = _data()
    opt = IVON(model.parameters(), lr=0.1, ess=6)

    def closure():
        opt.zero_grad()
        loss = ((model(x) - y) ** 2).mean() * math.nan
        loss.backward()
        return loss

    before = _snapshot(model, opt)
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[0\]"):
        opt.step(closure)
    _same(before, _snapshot(model, opt))


# ------------------------------------------------------------------------------------------ from_subset
class _Subset:
    def __init__(self, masks):
        self._masks = masks
        self.names = tuple(masks)

    def mask(self, name):
        return self._masks[name]


@pytest.mark.parametrize(
    ("masks", "error", "match"),
    [
        ({"9.weight": torch.ones(4, 3, dtype=torch.bool)}, ValueError, "9.weight"),
        ({"0.weight": torch.ones(3, 4, dtype=torch.bool)}, ValueError, r"0\.weight.*\(4, 3\)"),
        ({"0.weight": torch.ones(4, 3)}, ValueError, "bool"),
        ({"0.weight": [[True] * 3] * 4}, ValueError, "list"),
        ({"0.weight": torch.zeros(4, 3, dtype=torch.bool)}, ValueError, "no stochastic entries"),
        ({}, ValueError, "no stochastic entries"),
    ],
)
def test_from_subset_bad_masks(masks, error, match):
    with pytest.raises(error, match=match):
        IVON.from_subset(_mlp(), _Subset(masks), lr=0.1, ess=10)


def test_from_subset_bad_arguments():
    model = _mlp()
    model[0].weight.requires_grad_(False)
    with pytest.raises(ValueError, match="frozen"):
        IVON.from_subset(
            model, _Subset({"0.weight": torch.ones(4, 3, dtype=torch.bool)}), lr=0.1, ess=1
        )
    with pytest.raises(TypeError, match="subset"):
        IVON.from_subset(_mlp(), {"0.weight": torch.ones(4, 3, dtype=torch.bool)}, lr=0.1, ess=1)
    with pytest.raises(TypeError, match=r"nn\.Module"):
        IVON.from_subset([torch.zeros(2)], _Subset({}), lr=0.1, ess=1)


# ------------------------------------------------------------------------------------------ load_state_dict
def _trained(seed=0, hidden=4):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(3, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 2)
    ).double()
    x, y = _data()
    opt = IVON(
        model.named_parameters(), lr=0.1, ess=6, generator=torch.Generator().manual_seed(seed)
    )
    _train_step(model, opt, x, y)
    return model, opt


def _assert_unchanged_and_usable(model, opt, before, groups_before):
    _same(before, _snapshot(model, opt))
    assert [
        {k: v for k, v in g.items() if k != "params"} for g in opt.param_groups
    ] == groups_before
    _train_step(model, opt, *_data())
    assert all(torch.isfinite(p).all() for p in model.parameters())


def _groups(opt):
    return [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]


def test_load_adamw_state_dict_is_refused_before_anything_changes():
    """Issue #16: AdamW's state dict raised KeyError 'ess' after param_groups were replaced."""
    model, opt = _trained()
    adam = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.ones(1, 3, dtype=torch.float64)).sum().backward()
    adam.step()
    before, groups = _snapshot(model, opt), _groups(opt)
    with pytest.raises(ValueError, match="not an IVON"):
        opt.load_state_dict(adam.state_dict())
    _assert_unchanged_and_usable(model, opt, before, groups)


def test_load_state_of_a_differently_shaped_model_names_the_parameter():
    """Issue #16: the state of another model loaded, and the next step failed with a raw size mismatch."""
    _, wide = _trained(hidden=5)
    model, opt = _trained(hidden=4)
    before, groups = _snapshot(model, opt), _groups(opt)
    with pytest.raises(ValueError, match=r"'0\.weight'.*\(5, 3\).*\(4, 3\)"):
        opt.load_state_dict(wide.state_dict())
    _assert_unchanged_and_usable(model, opt, before, groups)


def _corruptions():
    """(description, function that corrupts a copy of a valid state dict, expected error, message)."""

    def set_state(key, value, p=0):
        def f(sd):
            sd["state"][p][key] = value

        return f

    def set_group(key, value):
        def f(sd):
            sd["param_groups"][0][key] = value

        return f

    return [
        ("not a dict", lambda sd: [], TypeError, "dict"),
        ("no state", lambda sd: sd.pop("state"), ValueError, "'state'"),
        ("no groups", lambda sd: sd.pop("param_groups"), ValueError, "'param_groups'"),
        (
            "extra group",
            lambda sd: sd["param_groups"].append(dict(sd["param_groups"][0])),
            ValueError,
            "2 parameter groups",
        ),
        (
            "fewer params",
            lambda sd: sd["param_groups"][0]["params"].pop(),
            ValueError,
            "3 parameters",
        ),
        ("missing state", lambda sd: sd["state"].pop(1), ValueError, "'0.bias'"),
        ("missing hess", lambda sd: sd["state"][2].pop("hess"), ValueError, r"'2\.weight'.*'hess'"),
        (
            "nan hess",
            set_state("hess", torch.full((4,), math.nan, dtype=torch.float64), 1),
            ValueError,
            "finite",
        ),
        (
            "negative hess",
            set_state("hess", -torch.ones(4, 3, dtype=torch.float64)),
            ValueError,
            "positive",
        ),
        (
            "int momentum",
            set_state("momentum", torch.zeros(4, 3, dtype=torch.long)),
            ValueError,
            "floating",
        ),
        ("bad lr", set_group("lr", -1.0), ValueError, "group 0: IVON: lr"),
        ("missing ess", lambda sd: sd["param_groups"][0].pop("ess"), ValueError, "'ess'"),
        ("bad step", set_group("step", -3), ValueError, "step"),
        ("float step", set_group("step", 1.5), TypeError, "step"),
        # Issue 34: no step restarted at 0 silently; unknown keys were kept.
        ("no step", lambda sd: sd["param_groups"][0].pop("step"), ValueError, "has no 'step'"),
        (
            "unknown key",
            lambda sd: sd.__setitem__("extra", 1),
            ValueError,
            r"unknown entries \['extra'\]",
        ),
        (
            "unknown group key",
            set_group("lrr", 0.1),
            ValueError,
            r"group 0 has unknown entries \['lrr'\]",
        ),
        (
            "unknown state key",
            set_state("exp_avg", torch.zeros(4, 3)),
            ValueError,
            r"unknown state entries",
        ),
        (
            "bad generator state",
            lambda sd: sd.__setitem__("generator_state", [1, 2]),
            TypeError,
            "generator_state",
        ),
    ]


@pytest.mark.parametrize("case", _corruptions(), ids=[c[0] for c in _corruptions()])
def test_corrupt_state_dicts_are_refused_and_leave_the_optimizer_usable(case):
    what, corrupt, error, match = case
    model, opt = _trained()
    sd = opt.state_dict()
    sd = {
        "state": {k: dict(v) for k, v in sd["state"].items()},
        "param_groups": [dict(g, params=list(g["params"])) for g in sd["param_groups"]],
        "generator_state": sd["generator_state"],
    }
    out = corrupt(sd)
    if what == "not a dict":
        sd = out
    before, groups = _snapshot(model, opt), _groups(opt)
    with pytest.raises(error, match=match):
        opt.load_state_dict(sd)
    _assert_unchanged_and_usable(model, opt, before, groups)
