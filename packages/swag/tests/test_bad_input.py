"""Bad input to collect_swag, SWAG and the load path gets a clear error (issue #16)."""

import json
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import save_file

from partialbayes.swag import (
    SWAG,
    NonFiniteLossError,
    classification_loss,
    collect_swag,
    load_swag,
    update_moments,
)

FILES = settings(suppress_health_check=[HealthCheck.function_scoped_fixture])


def collected(helpers, dtype=torch.float32, **kw):
    model = helpers.tiny_net(0, dtype=dtype)
    subset = helpers.partial_subset(model)
    options = {"lr": 0.05, "n_steps": 8, "snapshot_every": 2, "max_rank": 3, "progress": False}
    options.update(kw)
    return (
        model,
        subset,
        collect_swag(model, subset, helpers.x_batches(model), loss_fn=helpers.x_loss, **options),
    )


# --- the defects ----------------------------------------------------------------------------


def test_huge_learning_rate_stops_naming_the_step_instead_of_nan_moments(helpers):
    # Before the fix: the float32 second moment overflowed and every variance and sample was NaN.
    model = helpers.tiny_net(0, dtype=torch.float32)
    subset = helpers.partial_subset(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(NonFiniteLossError, match=r"overflow float32.*SGD step 2") as err:
        collect_swag(
            model,
            subset,
            helpers.x_batches(model),
            lr=1e30,
            n_steps=10,
            snapshot_every=2,
            loss_fn=helpers.x_loss,
            progress=False,
        )
    assert err.value.step == 2
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n])  # the MAP is restored


def test_float64_moments_take_the_same_snapshots(helpers):
    # The advice of the message works: in float64 the squares of 1e20-sized entries are finite.
    model = helpers.tiny_net(0, dtype=torch.float32)
    swag = SWAG(model, helpers.partial_subset(model), max_rank=3, dtype=torch.float64)
    with torch.no_grad():
        model.fc1.weight.mul_(1e20)
    swag.collect(model)
    assert bool(torch.isfinite(swag.sq_mean).all())
    small = SWAG(model, helpers.partial_subset(model), max_rank=3)
    with pytest.raises(ValueError, match="overflow float32"):
        small.collect(model)
    assert small.n_snapshots == 0  # refused before anything was folded in
    assert not bool(small._sq_mean.any())


@given(peak=st.floats(1.9e19, 3e38))
def test_update_moments_refuses_squares_that_overflow(peak):
    w = torch.tensor([1.0, peak], dtype=torch.float32)
    with pytest.raises(ValueError, match="overflow float32"):
        update_moments(torch.zeros(2), torch.zeros(2), w, 0)


@pytest.mark.parametrize("bad", [3, -1, 7])
def test_labels_out_of_range_name_the_step_and_batch(helpers, bad):
    model = helpers.tiny_net(0)
    subset = helpers.partial_subset(model)
    batches = helpers.x_batches(model, n_batches=3)
    batches[2]["labels"] = batches[2]["labels"].clone()
    batches[2]["labels"][1] = bad
    for loss_fn in (
        None,
        helpers.x_loss,
    ):  # the default loss checks; a user's IndexError is named too
        with pytest.raises(ValueError, match=r"SGD step 3 \(batch 2 of pass 0\)"):
            collect_swag(
                model,
                subset,
                batches,
                lr=0.05,
                n_steps=6,
                snapshot_every=2,
                loss_fn=loss_fn,
                progress=False,
            )
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 3\)"):
        classification_loss(model, batches[2])


def test_ignored_positions_are_allowed(helpers):
    model = helpers.tiny_net(0)
    batch = helpers.x_batches(model, n_batches=1)[0]
    batch["labels"] = batch["labels"].clone()
    batch["labels"][0] = -100
    assert torch.isfinite(classification_loss(model, batch))
    batch["labels"] = batch["labels"].float()
    with pytest.raises(TypeError, match="labels must be integer class indices"):
        classification_loss(model, batch)


# --- hyper-parameters ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"lr": math.nan}, ValueError, "lr"),
        ({"lr": math.inf}, ValueError, "lr"),
        ({"lr": -0.1}, ValueError, "lr"),
        ({"lr": True}, TypeError, "lr"),
        ({"lr": "0.1"}, TypeError, "lr"),
        ({"n_steps": True}, TypeError, "n_steps"),
        ({"n_steps": 4.0}, TypeError, "n_steps"),
        ({"n_steps": 0}, ValueError, "n_steps"),
        ({"snapshot_every": 0}, ValueError, "snapshot_every"),
        ({"snapshot_every": 1.5}, TypeError, "snapshot_every"),
        ({"momentum": 1.0}, ValueError, "momentum"),
        ({"momentum": math.nan}, ValueError, "momentum"),
        ({"weight_decay": math.nan}, ValueError, "weight_decay"),
        ({"weight_decay": -1.0}, ValueError, "weight_decay"),
        ({"max_rank": 1}, ValueError, "max_rank"),
        ({"max_rank": 2.0}, TypeError, "max_rank"),
    ],
)
def test_bad_hyper_parameters(helpers, kwargs, error, match):
    model = helpers.tiny_net(0)
    subset = helpers.partial_subset(model)
    options = {"lr": 0.1, "n_steps": 4, "snapshot_every": 2, "progress": False, **kwargs}
    with pytest.raises(error, match=match):
        collect_swag(model, subset, helpers.x_batches(model), loss_fn=helpers.x_loss, **options)


# --- the load path ------------------------------------------------------------------------------------


def saved(helpers, tmp_path, **kw):
    model, _, swag = collected(helpers, **kw)
    path = tmp_path / "swag.safetensors"
    swag.save(path)
    return model, path


def read(path):
    with safe_open(str(path), framework="pt") as f:
        return dict(f.metadata()), {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118


def rewrite(path, tensors, metadata):
    out = path.with_name("edited.safetensors")
    save_file(tensors, str(out), metadata=metadata)
    return out


@pytest.mark.parametrize("diagonal_only", [False, True])
def test_non_finite_or_missing_tensors_are_refused_naming_the_file(
    helpers, tmp_path, diagonal_only
):
    model, path = saved(helpers, tmp_path, diagonal_only=diagonal_only)
    meta, tensors = read(path)
    for key in tensors:
        for bad in (math.nan, math.inf):
            broken = dict(tensors)
            broken[key] = tensors[key].clone()
            broken[key].view(-1)[0] = bad
            with pytest.raises(ValueError, match=rf"edited\.safetensors.*'{key}' has NaN or inf"):
                load_swag(rewrite(path, broken, meta), model)
        rest = {k: v for k, v in tensors.items() if k != key}
        with pytest.raises(ValueError, match=rf"edited\.safetensors.*'{key}' is missing"):
            load_swag(rewrite(path, rest, meta), model)
        wrong = {**tensors, key: torch.zeros(3, 2)}
        with pytest.raises(ValueError, match=rf"edited\.safetensors.*'{key}' has shape"):
            load_swag(rewrite(path, wrong, meta), model)


def test_broken_metadata_is_refused_naming_the_file(helpers, tmp_path):
    model, path = saved(helpers, tmp_path)
    meta, tensors = read(path)
    for raw in ("{oops", "[]", json.dumps({"format": "partialbayes-swag", "version": 1})):
        with pytest.raises(ValueError, match=r"edited\.safetensors"):
            load_swag(rewrite(path, tensors, {"partialbayes_swag": raw}), model)
    fields = json.loads(meta["partialbayes_swag"])
    for key in ("subset", "names", "num_entries", "max_rank", "n_snapshots", "dtype"):
        broken = {k: v for k, v in fields.items() if k != key}
        with pytest.raises(ValueError, match=f"no '{key}' field"):
            load_swag(rewrite(path, tensors, {"partialbayes_swag": json.dumps(broken)}), model)
    for key, value in (("dtype", "int64"), ("n_snapshots", "4"), ("diagonal_only", 0)):
        broken = {**fields, key: value}
        with pytest.raises(ValueError, match=r"edited\.safetensors"):
            load_swag(rewrite(path, tensors, {"partialbayes_swag": json.dumps(broken)}), model)
    broken = {**fields, "subset": "{}"}
    with pytest.raises(ValueError, match=r"edited\.safetensors: the saved subset"):
        load_swag(rewrite(path, tensors, {"partialbayes_swag": json.dumps(broken)}), model)


@FILES
@given(data=st.data())
def test_every_truncation_is_refused_naming_the_file(helpers, tmp_path, data):
    path = tmp_path / "swag.safetensors"
    if not path.exists():
        collected(helpers)[2].save(path)
    blob = path.read_bytes()
    out = tmp_path / "truncated.safetensors"
    out.write_bytes(blob[: data.draw(st.integers(0, len(blob) - 1))])
    with pytest.raises(ValueError, match=r"truncated\.safetensors"):
        load_swag(out, helpers.tiny_net(0, dtype=torch.float32))


@FILES
@given(blob=st.binary(max_size=200))
def test_garbage_is_refused_naming_the_file(helpers, tmp_path, blob):
    out = tmp_path / "garbage.safetensors"
    out.write_bytes(blob)
    with pytest.raises(ValueError, match=r"garbage\.safetensors"):
        load_swag(out, helpers.tiny_net(0))


def test_missing_file(helpers, tmp_path):
    with pytest.raises(FileNotFoundError):
        load_swag(tmp_path / "none.safetensors", helpers.tiny_net(0))


def test_a_good_file_still_loads(helpers, tmp_path):
    model, path = saved(helpers, tmp_path)
    back = load_swag(path, model)
    assert back.n_snapshots == 4


def test_half_precision_moments_in_an_old_file_load_as_float32(helpers, tmp_path):
    model, path = saved(helpers, tmp_path)
    meta, tensors = read(path)
    fields = json.loads(meta["partialbayes_swag"])
    fields["dtype"] = "float16"
    half = {k: v.half() for k, v in tensors.items()}
    back = load_swag(rewrite(path, half, {"partialbayes_swag": json.dumps(fields)}), model)
    assert back.dtype == torch.float32
    torch.testing.assert_close(back.mean, tensors["mean"].half().float())


# --- issue #16 leftovers (fixed with issue #17) ------------------------------------------------------


@pytest.mark.parametrize("bad", [True, 2.5, 0, -1])
def test_sample_counts_are_checked(helpers, bad):
    _, _, swag = collected(helpers)
    with pytest.raises(ValueError, match="n must be a positive int"):
        swag.sample(bad)


def test_every_generator_argument_is_checked(helpers):
    _, _, swag = collected(helpers)
    x = helpers.x_batches(swag.model, 1)[0]["x"]
    for call in (
        lambda: swag.sample(2, generator=5),
        lambda: swag.sample_flat(2, generator=5),
        lambda: swag.sampled(generator=5),
        lambda: swag.predict(x, n_samples=2, generator=5),
        lambda: swag.predictive_samples(x, 2, generator=5),
    ):
        with pytest.raises(
            TypeError, match=r"generator must be a torch\.Generator or None, got int"
        ):
            call()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.int64])
def test_moment_dtypes_other_than_float32_and_float64_are_refused(helpers, dtype):
    model = helpers.tiny_net(0)
    with pytest.raises(TypeError, match=r"dtype must be torch\.float32 or torch\.float64"):
        SWAG(model, helpers.partial_subset(model), dtype=dtype)


@pytest.mark.parametrize("model_dtype", [torch.float16, torch.bfloat16])
def test_half_precision_models_keep_float32_moments_by_default(helpers, model_dtype):
    model = helpers.tiny_net(0, dtype=model_dtype)
    assert SWAG(model, helpers.partial_subset(model)).dtype == torch.float32


def test_swapped_refuses_non_finite_samples_and_leaves_the_model_alone(helpers):
    model, _, swag = collected(helpers)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    one = {n: v[0].clone() for n, v in swag.sample(1).items()}
    one["fc2.weight"][0] = math.nan
    with (
        pytest.raises(ValueError, match=r"NaN or inf entries in \['fc2.weight'\]"),
        swag.swapped(one),
    ):
        pass
    flat = swag.sample_flat()
    flat[3] = math.inf
    with (
        pytest.warns(DeprecationWarning, match=r"swapped\(model, weights\)"),
        pytest.raises(ValueError, match="NaN or inf"),
        swag.swapped(model, flat),
    ):
        pass
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n])
