"""Bad input: unsupported dtypes and options, generators, non-finite inputs and samples, broken files.

Issue #16: a file with NaN eigenvalues loaded silently (and `logit_mean_cov` returned NaN); garbage or
truncated files gave raw `SafetensorError` / `JSONDecodeError`, a missing tensor `KeyError '0:eig_a'`, none
naming the file; `KronLaplace(dtype=torch.float16)` was accepted and refused only at `fit`.
"""

import json
import math
import re
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).parent))
from _laplace_helpers import TinyNet, classification_data, kron_subset, random_factors

from partialbayes.curvature import (
    DenseLaplace,
    DiagLaplace,
    KronLaplace,
    LaplaceBase,
    dense_curvature,
    diag_curvature,
    kfac,
)

CLASSES = [KronLaplace, DiagLaplace, DenseLaplace]
FILES = settings(suppress_health_check=[HealthCheck.function_scoped_fixture])


def fitted(cls, model=None):
    model = TinyNet(0) if model is None else model
    subset = kron_subset(model)
    la = cls(model, subset, prior_precision=0.7)
    g = torch.Generator().manual_seed(1)
    if cls is KronLaplace:
        curv = random_factors(la, 1)
    elif cls is DiagLaplace:
        curv = {
            n: torch.rand(subset.num_entries(n), generator=g, dtype=torch.float64)
            for n in subset.names
        }
    else:
        p = subset.num_entries()
        x = torch.randn(p, p, generator=g, dtype=torch.float64)
        curv = x @ x.T
    la.fit_curvature(curv, map_loss=3.0, n_data=9, n_outputs=3)
    return la


def saved(cls, tmp_path):
    path = tmp_path / f"{cls.__name__}.safetensors"
    fitted(cls).save(path)
    return path


def read(path):
    with safe_open(str(path), framework="pt") as f:
        return dict(f.metadata()), {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118


def rewrite(path, tensors, metadata):
    out = path.with_name("edited.safetensors")
    save_file(tensors, str(out), metadata=metadata)
    return out


# --- dtype at construction -------------------------------------------------------------------------


@pytest.mark.parametrize("cls", CLASSES)
@pytest.mark.parametrize(
    "dtype", [torch.float16, torch.bfloat16, torch.int64, torch.complex64, "float32"], ids=str
)
def test_unsupported_dtypes_are_refused_at_construction(cls, dtype):
    model = TinyNet(0)
    with pytest.raises(TypeError, match=r"dtype must be torch\.float32 or torch\.float64"):
        cls(model, kron_subset(model), dtype=dtype)


# --- the load path ---------------------------------------------------------------------------------


@pytest.mark.parametrize("cls", CLASSES)
def test_non_finite_curvature_is_refused_at_load(cls, tmp_path):
    path = saved(cls, tmp_path)
    meta, tensors = read(path)
    for key in [k for k in tensors if k.startswith("curv:")][:2]:
        for bad in (math.nan, math.inf):
            broken = dict(tensors)
            broken[key] = tensors[key].clone()
            broken[key].view(-1)[0] = bad
            out = rewrite(path, broken, meta)
            with pytest.raises(ValueError, match=rf"edited\.safetensors.*'{key}' has 1 NaN or inf"):
                LaplaceBase.load(out, TinyNet(0))


def test_nan_eigenvalues_of_a_kron_posterior(tmp_path):
    # The case: NaN in an eigenvalue tensor used to load and give NaN covariances.
    path = saved(KronLaplace, tmp_path)
    meta, tensors = read(path)
    key = next(k for k in tensors if k.endswith(":eig_a"))
    tensors[key] = torch.full_like(tensors[key], math.nan)
    with pytest.raises(ValueError, match=f"'{key}'"):
        KronLaplace.load(rewrite(path, tensors, meta), TinyNet(0))


@pytest.mark.parametrize("cls", CLASSES)
def test_every_missing_tensor_is_named(cls, tmp_path):
    path = saved(cls, tmp_path)
    meta, tensors = read(path)
    for key in tensors:
        rest = {k: v for k, v in tensors.items() if k != key}
        out = rewrite(path, rest, meta)
        with pytest.raises(ValueError, match=rf"edited\.safetensors.*tensor '{key}' is missing"):
            cls.load(out, TinyNet(0))


@pytest.mark.parametrize("cls", CLASSES)
def test_tensors_of_the_wrong_shape(cls, tmp_path):
    path = saved(cls, tmp_path)
    meta, tensors = read(path)
    for key in [k for k in tensors if not k.startswith("map:")][:3]:
        broken = dict(tensors)
        broken[key] = torch.ones(tensors[key].numel() + 1, dtype=tensors[key].dtype)
        with pytest.raises(ValueError, match=r"edited\.safetensors"):
            cls.load(rewrite(path, broken, meta), TinyNet(0))


@FILES
@given(data=st.data())
def test_every_truncation_is_refused_naming_the_file(tmp_path, data):
    path = tmp_path / "post.safetensors"
    if not path.exists():
        fitted(KronLaplace).save(path)
    blob = path.read_bytes()
    cut = data.draw(st.integers(0, len(blob) - 1))
    out = tmp_path / "truncated.safetensors"
    out.write_bytes(blob[:cut])
    with pytest.raises(ValueError, match=r"truncated\.safetensors"):
        KronLaplace.load(out, TinyNet(0))


@FILES
@given(blob=st.binary(max_size=200))
def test_garbage_files_are_refused_naming_the_file(tmp_path, blob):
    out = tmp_path / "garbage.safetensors"
    out.write_bytes(blob)
    with pytest.raises(ValueError, match=r"garbage\.safetensors"):
        KronLaplace.load(out, TinyNet(0))


def test_missing_file_and_directory(tmp_path):
    with pytest.raises(FileNotFoundError):
        KronLaplace.load(tmp_path / "nothing.safetensors", TinyNet(0))
    with pytest.raises(ValueError, match="is a folder, not a saved posterior file"):
        KronLaplace.load(tmp_path, TinyNet(0))


def test_broken_metadata(tmp_path):
    path = saved(KronLaplace, tmp_path)
    meta, tensors = read(path)
    for raw in ("{not json", "[1, 2]", json.dumps({"format": "other"})):
        with pytest.raises(ValueError, match=r"edited\.safetensors"):
            KronLaplace.load(rewrite(path, tensors, {"partialbayes": raw}), TinyNet(0))
    fields = json.loads(meta["partialbayes"])
    for key in ("subset", "dtype", "options", "modules", "n_data", "sigma_fit"):
        broken = {k: v for k, v in fields.items() if k != key}
        with pytest.raises(ValueError, match=f"no '{key}' field"):
            KronLaplace.load(
                rewrite(path, tensors, {"partialbayes": json.dumps(broken)}), TinyNet(0)
            )
    for key, value in (
        ("dtype", "torch.float16"),
        ("format", "partialbayes.curvature.Magic"),
        ("n_data", "9"),
        ("modules", ["l0"]),
    ):
        broken = {**fields, key: value}
        with pytest.raises(ValueError, match=r"edited\.safetensors"):
            KronLaplace.load(
                rewrite(path, tensors, {"partialbayes": json.dumps(broken)}), TinyNet(0)
            )
    broken = {**fields, "options": {**fields["options"], "likelihood": "poisson"}}
    with pytest.raises(ValueError, match=r"saved settings are invalid.*likelihood"):
        KronLaplace.load(rewrite(path, tensors, {"partialbayes": json.dumps(broken)}), TinyNet(0))


def test_files_of_the_previous_format_are_refused_with_a_re_save_message(tmp_path):
    """Version 1 (``partialbayes.curvature.Laplace``, before the shared posterior-file module): re-save."""
    path = saved(KronLaplace, tmp_path)
    meta, tensors = read(path)
    old = {
        **json.loads(meta["partialbayes"]),
        "format": "partialbayes.curvature.Laplace",
        "version": 1,
    }
    with pytest.raises(ValueError, match=r"edited\.safetensors.*version 1.*re-saved"):
        KronLaplace.load(rewrite(path, tensors, {"partialbayes": json.dumps(old)}), TinyNet(0))


@pytest.mark.parametrize("cls", CLASSES)
def test_save_creates_the_folder_and_refuses_a_folder(cls, tmp_path):
    """Issue #27: saving into a missing folder raised a SafetensorError naming a temporary file."""
    la = fitted(cls)
    path = tmp_path / "new" / "deeper" / "post.safetensors"
    la.save(path)
    assert type(LaplaceBase.load(path, TinyNet(0))) is cls
    with pytest.raises(ValueError, match=r"is a folder"):
        la.save(tmp_path / "new")


def test_a_good_file_still_loads(tmp_path):
    la = fitted(DiagLaplace)
    path = tmp_path / "ok.safetensors"
    la.save(path)
    back = DiagLaplace.load(path, TinyNet(0))
    x, _ = classification_data(3, 0)
    torch.testing.assert_close(back.logit_mean_cov(x)[1], la.logit_mean_cov(x)[1])


# --- issue #16 leftovers (fixed with issue #17) ----------------------------------------------------


@pytest.mark.parametrize("num_classes", [0, True, 2.5])
def test_bad_num_classes_refused_at_construction(num_classes):
    model = TinyNet(0)
    with pytest.raises((ValueError, TypeError), match="num_classes"):
        KronLaplace(model, kron_subset(model), num_classes=num_classes)


def test_sample_count_and_generator_are_checked():
    la = fitted(KronLaplace)
    with pytest.raises(TypeError, match="n must be"):
        la.sample(True)
    with pytest.raises(TypeError, match="generator"):
        la.sample(2, generator=5)


def test_logit_mean_cov_of_non_finite_inputs_raises():
    la = fitted(KronLaplace)
    x, _ = classification_data(3, 0)
    x[0, 0] = math.nan
    with pytest.raises(ValueError, match="not finite"):
        la.logit_mean_cov(x)


@pytest.mark.parametrize("fn", [diag_curvature, dense_curvature])
def test_curvature_routines_refuse_integer_dtypes_and_bad_generators(fn):
    model = TinyNet(0).eval()
    x, y = classification_data(4, 0)
    with pytest.raises((TypeError, ValueError), match="dtype"):
        fn(model, [(x, y)], kron_subset(model), dtype=torch.int64)
    with pytest.raises(TypeError, match="generator"):
        fn(model, [(x, y)], kron_subset(model), fisher="mc", generator=5)


@pytest.mark.parametrize("cls", CLASSES)
def test_every_generator_argument_is_checked(cls):
    la = fitted(cls)
    x, y = classification_data(3, 0)
    for call in (
        lambda: la.sample(2, generator=5),
        lambda: la.sampled(generator=5).__enter__(),
        lambda: la.predict(x, link="mc", generator=5),
        lambda: la.predictive_samples(x, 2, generator=5),
        lambda: la.fit([(x, y)], generator=5),
    ):
        with pytest.raises(
            TypeError, match=r"generator must be a torch\.Generator or None .*, got int"
        ):
            call()
    for bad in (True, 2.5, 0):
        with pytest.raises(
            TypeError if isinstance(bad, bool) or not isinstance(bad, int) else ValueError,
            match="n must be",
        ):
            la.sample(bad)


@pytest.mark.parametrize("fn", [kfac, diag_curvature, dense_curvature])
@pytest.mark.parametrize("num_classes", [0, True, 2.5])
def test_curvature_routines_refuse_bad_num_classes(fn, num_classes):
    model = TinyNet(0).eval()
    x, y = classification_data(4, 0)
    error = ValueError if num_classes == 0 else TypeError
    with pytest.raises(error, match="num_classes must be"):
        fn(model, [(x, y)], kron_subset(model), num_classes=num_classes)


def test_kfac_refuses_integer_dtypes_like_the_other_routines():
    model = TinyNet(0).eval()
    x, y = classification_data(4, 0)
    with pytest.raises(TypeError, match=r"dtype must be torch\.float32 or torch\.float64"):
        kfac(model, [(x, y)], kron_subset(model), dtype=torch.int64)


@pytest.mark.parametrize("cls", CLASSES)
def test_non_finite_inputs_raise_in_every_predictive(cls):
    la = fitted(cls)
    x, y = classification_data(3, 0)
    x[1, 2] = math.nan
    for call in (
        lambda: la.logit_mean_cov(x),
        lambda: la.predict(x),
        lambda: la.predictive_samples(x, 2),
        lambda: la.optimize_prior_precision("val_nll", val_loader=[(x, y)], grid=[0.5, 1.0]),
    ):
        with pytest.raises(ValueError, match="not finite"):
            call()


@pytest.mark.parametrize("cls", CLASSES)
def test_swapped_refuses_a_non_finite_sample_and_leaves_the_model_alone(cls):
    la = fitted(cls)
    before = {n: p.detach().clone() for n, p in la.model.named_parameters()}
    one = {n: v[0] for n, v in la.sample(1, generator=torch.Generator().manual_seed(0)).items()}
    name = la.subset.names[1]
    one[name] = one[name].clone()
    one[name][0] = math.nan
    with (
        pytest.raises(ValueError, match=rf"NaN or inf entries in \['{re.escape(name)}'\]"),
        la.swapped(one),
    ):
        pass
    for n, p in la.model.named_parameters():
        assert torch.equal(p, before[n])


def test_target_ids_are_for_classification():
    model = TinyNet(0)
    x = torch.randn(5, 3, dtype=torch.float64)
    la = DiagLaplace(model, kron_subset(model), likelihood="regression").fit([(x, x)])
    with pytest.raises(ValueError, match="target_ids selects answer tokens of a classifier"):
        la.predict(x, target_ids=[0])


def test_one_batch_given_as_the_loader_names_the_fix():
    model = TinyNet(0)
    x, y = classification_data(4, 0)
    la = KronLaplace(model, kron_subset(model))
    with pytest.raises(TypeError, match=r"Pass a list of batches \(\[batch\]\)"):
        la.fit({"x": x, "labels": y})
