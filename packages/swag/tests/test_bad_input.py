"""Bad input to collect_swag, SWAG and the load path gets a clear error (issue #16)."""

import json
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import save_file

from partialbayes.swag import SWAG, NonFiniteLossError, collect_swag, predictive_nll
from partialbayes.swag._moments import update_moments_
from partialbayes.swag._train import classification_loss

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
        update_moments_(torch.zeros(2), torch.zeros(2), w, 0)


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
    with pytest.raises(ValueError, match=r"labels \(other than -100\) must lie in \[0, 3\)"):
        classification_loss(model, batches[2])


def test_ignored_positions_are_allowed(helpers):
    model = helpers.tiny_net(0)
    batch = helpers.x_batches(model, n_batches=1)[0]
    batch["labels"] = batch["labels"].clone()
    batch["labels"][0] = -100
    assert torch.isfinite(classification_loss(model, batch))
    batch["labels"] = batch["labels"].float()
    with pytest.raises(TypeError, match=r"labels \(other than -100\) must be an integer tensor"):
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
            with pytest.raises(ValueError, match=rf"edited\.safetensors.*'{key}' has 1 NaN or inf"):
                SWAG.load(rewrite(path, broken, meta), model)
        rest = {k: v for k, v in tensors.items() if k != key}
        with pytest.raises(ValueError, match=rf"edited\.safetensors.*'{key}' is missing"):
            SWAG.load(rewrite(path, rest, meta), model)
        wrong = {**tensors, key: torch.zeros(3, 2)}
        with pytest.raises(ValueError, match=rf"edited\.safetensors.*'{key}' has shape"):
            SWAG.load(rewrite(path, wrong, meta), model)


def test_broken_metadata_is_refused_naming_the_file(helpers, tmp_path):
    model, path = saved(helpers, tmp_path)
    meta, tensors = read(path)
    for raw in ("{oops", "[]", json.dumps({"format": "partialbayes.swag.SWAG", "version": 2})):
        with pytest.raises(ValueError, match=r"edited\.safetensors"):
            SWAG.load(rewrite(path, tensors, {"partialbayes": raw}), model)
    fields = json.loads(meta["partialbayes"])
    for key in ("subset", "structure", "max_rank", "n_snapshots", "dtype", "likelihood"):
        broken = {k: v for k, v in fields.items() if k != key}
        with pytest.raises(ValueError, match=f"no '{key}' field"):
            SWAG.load(rewrite(path, tensors, {"partialbayes": json.dumps(broken)}), model)
    for key, value in (
        ("dtype", "int64"),
        ("n_snapshots", "4"),
        ("n_snapshots", 0),
        ("diagonal_only", 0),
        ("max_rank", 1),
        ("likelihood", "poisson"),
        ("sigma_noise", -1.0),
    ):
        broken = {**fields, key: value}
        with pytest.raises(ValueError, match=r"edited\.safetensors"):
            SWAG.load(rewrite(path, tensors, {"partialbayes": json.dumps(broken)}), model)
    broken = {**fields, "subset": "{}"}
    with pytest.raises(ValueError, match=r"edited\.safetensors': the saved subset"):
        SWAG.load(rewrite(path, tensors, {"partialbayes": json.dumps(broken)}), model)
    too_many = {
        **tensors,
        "deviations": torch.zeros(tensors["mean"].shape[0], 4),
    }  # 4 > n_snapshots
    with pytest.raises(ValueError, match=r"edited\.safetensors.*'deviations' has shape"):
        SWAG.load(rewrite(path, too_many, meta), model)


def test_files_of_version_1_are_refused_with_a_re_save_message(helpers, tmp_path):
    model, path = saved(helpers, tmp_path)
    meta, tensors = read(path)
    old = {"partialbayes_swag": json.dumps({"format": "partialbayes-swag", "version": 1})}
    with pytest.raises(ValueError, match=r"edited\.safetensors.*earlier partialbayes; re-save it"):
        SWAG.load(rewrite(path, tensors, old), model)
    other = {"partialbayes": json.dumps({**json.loads(meta["partialbayes"]), "version": 1})}
    with pytest.raises(ValueError, match=r"edited\.safetensors.*version 1.*re-saved"):
        SWAG.load(rewrite(path, tensors, other), model)


def test_save_creates_the_folder_is_atomic_and_refuses_a_folder(helpers, tmp_path):
    # Before the fix: a missing folder or a folder path gave SafetensorError naming a temporary file.
    model, _, swag = collected(helpers)
    target = tmp_path / "new" / "deeper" / "swag.safetensors"
    swag.save(target)
    assert SWAG.load(target, model).n_snapshots == swag.n_snapshots
    assert sorted(p.name for p in target.parent.iterdir()) == ["swag.safetensors"]
    with pytest.raises(ValueError, match="it is a folder"):
        swag.save(tmp_path)


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
        SWAG.load(out, helpers.tiny_net(0, dtype=torch.float32))


@FILES
@given(blob=st.binary(max_size=200))
def test_garbage_is_refused_naming_the_file(helpers, tmp_path, blob):
    out = tmp_path / "garbage.safetensors"
    out.write_bytes(blob)
    with pytest.raises(ValueError, match=r"garbage\.safetensors"):
        SWAG.load(out, helpers.tiny_net(0))


def test_missing_file(helpers, tmp_path):
    with pytest.raises(FileNotFoundError):
        SWAG.load(tmp_path / "none.safetensors", helpers.tiny_net(0))


def test_a_good_file_still_loads(helpers, tmp_path):
    model, path = saved(helpers, tmp_path)
    back = SWAG.load(path, model)
    assert back.n_snapshots == 4


def test_half_precision_moments_in_a_file_load_as_float32(helpers, tmp_path):
    model, path = saved(helpers, tmp_path)
    meta, tensors = read(path)
    fields = json.loads(meta["partialbayes"])
    fields["dtype"] = "float16"
    half = {k: v.half() for k, v in tensors.items()}
    back = SWAG.load(rewrite(path, half, {"partialbayes": json.dumps(fields)}), model)
    assert back.dtype == torch.float32
    torch.testing.assert_close(back.mean, tensors["mean"].half().float())


# --- issue #16 leftovers (fixed with issue #17) ------------------------------------------------------


@pytest.mark.parametrize("bad", [True, 2.5, 0, -1])
def test_sample_counts_are_checked(helpers, bad):
    _, _, swag = collected(helpers)
    with pytest.raises(
        TypeError if isinstance(bad, bool) or not isinstance(bad, int) else ValueError,
        match="n must be",
    ):
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
            TypeError, match=r"generator must be a torch\.Generator or None .*, got int"
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
    with pytest.raises(ValueError, match="NaN or inf"), swag.swapped(swag.unflatten(flat)):
        pass
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n])


# --- issue #27 -------------------------------------------------------------------------------------


def test_too_few_snapshots_to_sample_are_refused_before_collecting(helpers):
    # Before the fix: n_steps=3 with snapshot_every=2 returned a one-snapshot SWAG that failed at predict.
    model = helpers.tiny_net(0)
    subset = helpers.partial_subset(model)
    kw = {"lr": 0.05, "snapshot_every": 2, "loss_fn": helpers.x_loss, "progress": False}
    with pytest.raises(
        ValueError, match=r"n_steps=3 with snapshot_every=2 gives 1 snapshot.*at least 2"
    ):
        collect_swag(model, subset, helpers.x_batches(model), n_steps=3, **kw)
    diag = collect_swag(
        model, subset, helpers.x_batches(model), n_steps=3, diagonal_only=True, **kw
    )
    assert diag.n_snapshots == 1
    assert diag.sample(2)["fc1.weight"].shape == (2, 4)


def unlabelled(batch):
    return {**batch, "labels": torch.full_like(batch["labels"], -100)}


@pytest.mark.parametrize("loss", ["default", "custom"])
def test_batches_with_no_labelled_output_are_skipped_with_one_warning(helpers, loss):
    # Before the fix: an all -100 batch made the mean cross-entropy NaN, reported as a divergence
    # (NonFiniteLossError ... (lr=...)).
    model = helpers.tiny_net(0)
    subset = helpers.partial_subset(model)
    data = helpers.x_batches(model, n_batches=3)
    with_gaps = [data[0], unlabelled(data[1]), data[1], unlabelled(data[2]), data[2]]
    kw = {"lr": 0.05, "n_steps": 6, "snapshot_every": 2, "max_rank": 3, "progress": False}
    if loss == "custom":

        def loss_fn(m, b):  # ignores -100 itself, like Hugging Face's loss
            return torch.nn.functional.cross_entropy(m(b["x"]), b["labels"])

        kw["loss_fn"] = loss_fn
    with pytest.warns(RuntimeWarning, match="collect_swag skipped 4 of 10 batches") as record:
        swag = collect_swag(model, subset, with_gaps, **kw)
    assert len([w for w in record if "skipped" in str(w.message)]) == 1
    ref = collect_swag(model, subset, data, **kw)  # the same steps on the labelled batches
    torch.testing.assert_close(swag.mean, ref.mean, rtol=0, atol=0)
    torch.testing.assert_close(swag.deviations, ref.deviations, rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"every batch \(2\) has no labelled outputs"):
        collect_swag(model, subset, [unlabelled(b) for b in data[:2]], **kw)


def test_sequence_level_minus_100_is_no_label(helpers):
    model = helpers.tiny_net(0)
    batch = helpers.x_batches(model, n_batches=1)[0]
    labels = batch["labels"].clone()
    labels[[1, 4]] = -100
    keep = labels != -100
    loss = classification_loss(model, {**batch, "labels": labels})
    ref = torch.nn.functional.cross_entropy(model(batch["x"])[keep], labels[keep])
    torch.testing.assert_close(loss, ref)


def test_predictive_nll_skips_unlabelled_batches_and_refuses_all_unlabelled(helpers):
    # Before the fix: a loader of only -100 labels gave NaN silently.
    model, _, swag = collected(helpers, dtype=torch.float64)
    data = helpers.x_batches(model, n_batches=2)
    val = [(b["x"], b["labels"]) for b in data]
    gaps = [val[0], (val[1][0], torch.full_like(val[1][1], -100)), val[1]]
    with pytest.warns(RuntimeWarning, match="predictive_nll skipped 1 of 3 batches"):
        got = predictive_nll(swag, gaps, n_samples=3, generator=torch.Generator().manual_seed(0))
    ref = predictive_nll(swag, val, n_samples=3, generator=torch.Generator().manual_seed(0))
    assert got == pytest.approx(ref, rel=1e-12)
    with pytest.raises(ValueError, match=r"every batch \(1\) has no labelled outputs"):
        predictive_nll(swag, gaps[1:2], n_samples=2)


def test_an_empty_batch_is_named(helpers):
    # Before the fix: HF models failed deep inside with "cannot reshape tensor of 0 elements".
    model = helpers.tiny_net(0)
    subset = helpers.partial_subset(model)
    data = helpers.x_batches(model, n_batches=2)
    empty = {"x": data[0]["x"][:0], "labels": data[0]["labels"][:0]}
    with pytest.raises(ValueError, match=r"SGD step 2 \(batch 1 of pass 0\): empty batch"):
        collect_swag(model, subset, [data[0], empty], lr=0.05, n_steps=4, snapshot_every=2,
                     loss_fn=helpers.x_loss, progress=False)  # fmt: skip
    _, _, swag = collected(helpers, dtype=torch.float64)
    with pytest.raises(ValueError, match="validation batch 0: empty batch"):
        predictive_nll(swag, [(empty["x"], empty["labels"])], n_samples=2)


def test_a_meta_device_model_is_refused_by_name(helpers):
    # Before the fix: "Tensor.item() cannot be called on meta tensors".
    model = helpers.tiny_net(0)
    subset = helpers.partial_subset(model)
    meta = helpers.tiny_net(0, device="meta")
    with pytest.raises(ValueError, match=r"'fc1\.weight' of TinyNet is on the meta device"):
        SWAG(meta, subset)
    with pytest.raises(ValueError, match="meta device"):
        collect_swag(meta, subset, helpers.x_batches(model), lr=0.1, n_steps=4, snapshot_every=2,
                     loss_fn=helpers.x_loss, progress=False)  # fmt: skip
