"""The one posterior file format: atomic write, checked read, errors that name the file."""

from __future__ import annotations

import json
import os

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from safetensors.torch import save_file
from torch import nn

from partialbayes.predictive.internal import (
    PosteriorFile,
    read_posterior_file,
    write_posterior_file,
)

FMT = "partialbayes.test.Thing"


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))


def _write(path, model=None, **meta) -> dict[str, torch.Tensor]:
    tensors = {"mean": torch.randn(5, dtype=torch.float64), "idx": torch.arange(3)}
    write_posterior_file(
        path, tensors, {"format": FMT, "version": 2, "n": 7, **meta}, model=model or _model()
    )
    return tensors


def _read(path) -> PosteriorFile:
    return read_posterior_file(path, formats=FMT, version=2, fields={"n": int})


def test_round_trip_and_accessors(tmp_path):
    path = tmp_path / "p.safetensors"
    tensors = _write(path, dtype="torch.float32")
    f = _read(path)
    assert torch.equal(f.tensor("mean", (5,)), tensors["mean"])
    assert torch.equal(f.tensor("idx"), tensors["idx"])
    assert f.field("n", int) == 7
    assert f.dtype() == torch.float32
    f.check_model(_model())
    assert [p.name for p in tmp_path.iterdir()] == ["p.safetensors"]  # no temporary left


def test_shared_memory_tensors_and_devices_are_written(tmp_path):
    base = torch.randn(4, 3)
    write_posterior_file(
        tmp_path / "p",
        {"a": base, "b": base, "c": base[1]},
        {"format": FMT, "version": 2},
        model=_model(),
    )
    f = read_posterior_file(tmp_path / "p", formats=FMT, version=2)
    assert torch.equal(f.tensors["b"], base)
    assert torch.equal(f.tensors["c"], base[1])


def test_missing_parent_is_created_and_a_folder_is_refused(tmp_path):
    deep = tmp_path / "a" / "b" / "p.safetensors"
    _write(deep)
    assert deep.is_file()
    with pytest.raises(ValueError, match=r"it is a folder; give a file path such as .*posterior"):
        _write(tmp_path / "a")
    with pytest.raises(ValueError, match="is a folder, not a saved posterior"):
        _read(tmp_path / "a")


def test_interrupted_write_keeps_the_previous_file(tmp_path):
    path = tmp_path / "p.safetensors"
    first = _write(path)
    with pytest.raises(TypeError):  # not JSON
        write_posterior_file(path, {}, {"format": FMT, "version": 2, "x": object()}, model=_model())
    assert torch.equal(_read(path).tensors["mean"], first["mean"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.safetensors"]


def test_another_model_is_refused_naming_the_parameter(tmp_path):
    _write(tmp_path / "p")
    other = nn.Sequential(nn.Linear(3, 5), nn.Linear(5, 2))
    with pytest.raises(
        ValueError, match=r"shape mismatches \['0.weight: saved \(4, 3\), model \(5, 3\)"
    ):
        _read(tmp_path / "p").check_model(other)


@pytest.mark.parametrize(
    ("meta", "match"),
    [
        ({"format": "partialbayes.other.Thing"}, "holds format 'partialbayes.other.Thing'"),
        ({"version": 1}, "version 1; expected 'partialbayes.test.Thing' version 2"),
        ({"n": "7"}, r"field 'n' has the wrong type \(str; expected int\)"),
        ({"n": True}, r"field 'n' has the wrong type \(bool"),
    ],
)
def test_wrong_metadata_is_named(tmp_path, meta, match):
    _write(tmp_path / "p", **meta)
    with pytest.raises(ValueError, match=match):
        _read(tmp_path / "p")


def test_missing_field_tensor_dtype_and_shape(tmp_path):
    _write(tmp_path / "p", dtype="int7")
    f = read_posterior_file(tmp_path / "p", formats=FMT, version=2)
    with pytest.raises(ValueError, match="has no 'k' field"):
        f.field("k", int)
    with pytest.raises(ValueError, match="tensor 'std' is missing"):
        f.tensor("std")
    with pytest.raises(ValueError, match=r"tensor 'mean' has shape \(5,\), expected \(6,\)"):
        f.tensor("mean", (6,))
    with pytest.raises(
        ValueError, match=r"unsupported dtype: field 'dtype' must be one of .*, got 'int7'"
    ):
        f.dtype()


def test_non_finite_tensor_and_foreign_headers(tmp_path):
    path = os.fspath(tmp_path / "p")
    meta = {"format": FMT, "version": 2, "n": 1, "structure": []}
    save_file(
        {"mean": torch.tensor([1.0, float("nan")])},
        path,
        metadata={"partialbayes": json.dumps(meta)},
    )
    with pytest.raises(ValueError, match="'mean' has 1 NaN or inf entries"):
        _read(path)
    save_file({"m": torch.zeros(1)}, path, metadata={"partialbayes_swag": "{}"})
    with pytest.raises(ValueError, match="earlier partialbayes; re-save it"):
        _read(path)
    save_file({"m": torch.zeros(1)}, path, metadata={"partialbayes": "[1, 2]"})
    with pytest.raises(ValueError, match="not a JSON object"):
        _read(path)
    save_file({"m": torch.zeros(1)}, path, metadata={"partialbayes": "{nope"})
    with pytest.raises(ValueError, match="not valid JSON"):
        _read(path)
    with pytest.raises(FileNotFoundError):
        _read(tmp_path / "missing")


@given(cut=st.integers(0, 10_000), junk=st.binary(max_size=64))
def test_truncated_or_garbage_files_name_the_file(tmp_path_factory, cut, junk):
    folder = tmp_path_factory.mktemp("files")
    path = folder / "p.safetensors"
    _write(path)
    data = path.read_bytes()
    if cut >= len(data) or len(junk) == len(data) - cut:  # intact length: may well parse
        return
    path.write_bytes(data[:cut] + junk)
    with pytest.raises(ValueError, match=r"p\.safetensors"):
        _read(path)
