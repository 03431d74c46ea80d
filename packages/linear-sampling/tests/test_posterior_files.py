"""`SampledLaplace.load` on truncated, garbage and inconsistent files (issue #16).

Expected: a ``ValueError`` naming the file (never a raw ``SafetensorError``, ``JSONDecodeError`` or
``KeyError``) and never a posterior holding NaN or inf samples.
"""

import json
import re
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from partialbayes.linear_sampling import SampledLaplace
from partialbayes.selection import KronBlock, Subset


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 3)).double()


def mlp_subset(model: nn.Module) -> Subset:
    return Subset.from_model(
        model, {"2.weight": KronBlock(cols=torch.tensor([1, 3])), "2.bias": KronBlock()}
    )


def pairs() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        (
            torch.randn(6, 3, generator=g, dtype=torch.float64),
            torch.randint(0, 3, (6,), generator=g),
        )
    ]


def _saved(tmp: Path) -> tuple[bytes, dict, dict]:
    model = mlp()
    post = SampledLaplace(model, mlp_subset(model)).fit(pairs(), n_samples=3, tol=1e-8)
    path = tmp / "good.safetensors"
    post.save(path)
    with safe_open(str(path), framework="pt") as f:
        meta = json.loads(f.metadata()["partialbayes"])
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    return path.read_bytes(), meta, tensors


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    return _saved(tmp_path_factory.mktemp("ls"))


def _refused(tmp: Path, data: bytes, fragment: str = "") -> None:
    path = tmp / "bad.safetensors"
    path.write_bytes(data)
    with pytest.raises(ValueError, match=re.escape(repr(str(path))) + ".*" + re.escape(fragment)):
        SampledLaplace.load(path, mlp())


def _file(tmp: Path, tensors: dict, meta) -> bytes:
    path = tmp / "built.safetensors"
    save_file(tensors, str(path), metadata={"partialbayes": json.dumps(meta)})
    return path.read_bytes()


def test_the_intact_file_loads(good, tmp_path):
    raw, _, tensors = good
    path = tmp_path / "ok.safetensors"
    path.write_bytes(raw)
    loaded = SampledLaplace.load(path, mlp())
    torch.testing.assert_close(loaded.samples, tensors["samples"])


@settings(max_examples=25, deadline=None)
@given(fraction=st.floats(0.0, 0.999))
def test_truncated_files(good, tmp_path_factory, fraction):
    raw = good[0]
    _refused(tmp_path_factory.mktemp("t"), raw[: int(fraction * len(raw))])


@settings(max_examples=25, deadline=None)
@given(data=st.binary(max_size=300))
def test_garbage_files(tmp_path_factory, data):
    _refused(tmp_path_factory.mktemp("g"), data)


@pytest.mark.parametrize("field", ["structure", "likelihood", "sigma_noise", "jitter", "subset"])
def test_a_missing_metadata_field_is_named(good, tmp_path, field):
    _, meta, tensors = good
    meta = {k: v for k, v in meta.items() if k != field}
    _refused(tmp_path, _file(tmp_path, tensors, meta), field)


def test_metadata_that_is_not_json_or_not_an_object(good, tmp_path):
    _, _, tensors = good
    path = tmp_path / "built.safetensors"
    save_file(tensors, str(path), metadata={"partialbayes": "{not json"})
    _refused(tmp_path, path.read_bytes(), "JSON")
    _refused(tmp_path, _file(tmp_path, tensors, [1, 2]), "JSON object")


@pytest.mark.parametrize("key", ["samples", "map", "prior_alpha"])
def test_a_missing_tensor_is_named(good, tmp_path, key):
    _, meta, tensors = good
    _refused(tmp_path, _file(tmp_path, {k: v for k, v in tensors.items() if k != key}, meta), key)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_samples_are_refused(good, tmp_path, bad):
    _, meta, tensors = good
    samples = tensors["samples"].clone()
    samples[0, 0] = bad
    _refused(tmp_path, _file(tmp_path, {**tensors, "samples": samples}, meta), "samples")


def test_samples_of_the_wrong_length_are_refused(good, tmp_path):
    _, meta, tensors = good
    samples = tensors["samples"][:-1].contiguous()
    _refused(tmp_path, _file(tmp_path, {**tensors, "samples": samples}, meta), "d=")


def test_a_non_positive_prior_precision_is_refused(good, tmp_path):
    _, meta, tensors = good
    alpha = -tensors["prior_alpha"].abs()
    _refused(
        tmp_path,
        _file(tmp_path, {**tensors, "prior_alpha": alpha}, meta),
        "prior precision alpha must be positive",
    )


def test_a_missing_file_raises_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError):
        SampledLaplace.load(tmp_path / "absent.safetensors", mlp())


def test_a_file_of_format_version_1_is_refused_with_re_save(good, tmp_path):
    _, meta, tensors = good
    assert meta["version"] == 2
    _refused(tmp_path, _file(tmp_path, tensors, {**meta, "version": 1}), "re-saved")
