"""The IVON posterior load path with truncated, garbage and inconsistent files (issues #16, #22).

Expected: a ``ValueError`` that names the file (never a raw ``SafetensorError`` / ``JSONDecodeError`` /
``KeyError``), and no posterior with NaN or inf means or NaN, inf or negative standard deviations. The files
are ``partialbayes.predictive`` posterior files, version 2; files of version 1 are refused with "re-save".
"""

import json
import math
import os
import re
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from safetensors.torch import save_file

from partialbayes.ivon import (
    IVON,
    GaussianPosterior,
    MultiIVON,
    ivon_posterior,
    load_posterior,
)


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2)
    ).double()


def _saved_bytes():
    model = _model()
    opt = IVON(model.parameters(), lr=0.1, ess=20, generator=torch.Generator().manual_seed(0))
    with opt.sampled_params(train=True):
        model(torch.ones(5, 3, dtype=torch.float64)).square().mean().backward()
    opt.step()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "post.safetensors"
        ivon_posterior(opt, model).save(path)
        return path.read_bytes(), {n: p.detach().clone() for n, p in model.named_parameters()}


RAW, MEANS = _saved_bytes()
META = {
    "format": "partialbayes.ivon.GaussianPosterior",
    "version": 2,
    "structure": [[n, list(t.shape)] for n, t in MEANS.items()],
    "components": 1,
    "parameters": list(MEANS),
    "likelihood": "classification",
    "sigma_noise": 1.0,
}
MIX = dict(META, format="partialbayes.ivon.MultiIVON")


def _load(data: bytes, fragment: str = "", load=load_posterior):
    """Loading ``data`` raises a ValueError naming the file (and ``fragment``, the field or tensor)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "bad.safetensors"
        path.write_bytes(data)
        with pytest.raises(ValueError, match=re.escape(fragment) if fragment else None) as err:
            load(path, _model())
        assert str(path) in str(err.value)


def _file(tensors, meta) -> bytes:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "x.safetensors"
        save_file(
            tensors,
            str(path),
            metadata={"partialbayes": meta if isinstance(meta, str) else json.dumps(meta)},
        )
        return path.read_bytes()


def _tensors(std_value=0.1):
    out = {f"0/mean/{n}": t for n, t in MEANS.items()}
    out.update({f"0/std/{n}": torch.full_like(t, std_value) for n, t in MEANS.items()})
    return out


def test_the_intact_file_loads():
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "ok.safetensors"
        path.write_bytes(RAW)
        post = load_posterior(path, _model())
        assert set(post.mean) == set(MEANS)
        path.write_bytes(_file(_tensors(), META))
        assert torch.equal(
            load_posterior(path, _model()).std["0.weight"],
            torch.full((4, 3), 0.1, dtype=torch.float64),
        )


@given(length=st.integers(0, len(RAW) - 1))
def test_truncated_files(length):
    _load(RAW[:length])


@given(data=st.binary(max_size=300))
def test_garbage_files(data):
    _load(data)


@given(data=st.binary(min_size=1, max_size=64), at=st.integers(8, len(RAW) - 1))
def test_files_with_overwritten_bytes_in_the_header(data, at):
    # Some overwrites leave a valid file (a space over the header's padding, a digit of sigma_noise, bytes of
    # the tensor data): those may load, but only as a posterior with finite means and finite std >= 0.
    header_end = 8 + int.from_bytes(RAW[:8], "little")
    at = min(at, header_end - 1)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "bad.safetensors"
        path.write_bytes(RAW[:at] + data + RAW[at + len(data) :])
        try:
            post, refusal = load_posterior(path, _model()), ""
        except ValueError as err:
            post, refusal = None, str(err)
    if post is None:
        assert str(path) in refusal
        return
    for name, std in post.std.items():
        assert bool(torch.isfinite(post.mean[name]).all())
        assert bool(torch.isfinite(std).all() & (std >= 0).all())


def test_a_valid_file_of_an_overwritten_header_may_load():
    # the padding of the header is spaces: overwriting one with a space changes nothing
    header_end = 8 + int.from_bytes(RAW[:8], "little")
    assert RAW[header_end - 1 : header_end] == b" "
    test_files_with_overwritten_bytes_in_the_header.hypothesis.inner_test(b" ", header_end - 1)


def test_missing_file_names_the_path_and_a_directory_is_refused():
    path = Path(tempfile.gettempdir()) / f"no-such-ivon-posterior-{os.getpid()}.safetensors"
    with pytest.raises(FileNotFoundError, match=re.escape(path.name)):
        load_posterior(path, _model())
    with tempfile.TemporaryDirectory() as tmp, pytest.raises(ValueError, match="is a folder"):
        load_posterior(tmp, _model())


def _without(key):
    return {k: v for k, v in META.items() if k != key}


def _one(key, value):
    tensors = _tensors()
    tensors[key] = value
    return tensors


NAN, INF = float("nan"), float("inf")
W = MEANS["0.weight"]
CASES = {
    # what: (file bytes, the fragment of the message)
    "metadata that is not JSON": (lambda: _file(_tensors(), "{not json"), "not valid JSON"),
    "metadata that is a list": (lambda: _file(_tensors(), "[1, 2]"), "not a JSON object"),
    "no partialbayes metadata": (lambda: _file_without_metadata(), "not a saved partialbayes"),
    "another format": (lambda: _file(_tensors(), dict(META, format="x")), "holds format 'x'"),
    "another version": (lambda: _file(_tensors(), dict(META, version=99)), "version 99"),
    "the file of 0.3": (lambda: _old_file(), "re-save"),
    "no 'parameters'": (lambda: _file(_tensors(), _without("parameters")), "no 'parameters' field"),
    "no 'structure'": (lambda: _file(_tensors(), _without("structure")), "no 'structure' field"),
    "no 'components'": (lambda: _file(_tensors(), _without("components")), "no 'components'"),
    "no 'likelihood'": (lambda: _file(_tensors(), _without("likelihood")), "no 'likelihood'"),
    "components 0": (lambda: _file(_tensors(), dict(META, components=0)), "'components' is 0"),
    "components a bool": (lambda: _file(_tensors(), dict(META, components=True)), "'components'"),
    "components a string": (lambda: _file(_tensors(), dict(META, components="1")), "'components'"),
    "a Gaussian of two runs": (
        lambda: _file(_two_runs(), dict(META, components=2)),
        "'components' is 2, which does not fit 'partialbayes.ivon.GaussianPosterior'",
    ),
    "more components than saved": (
        lambda: _file(_tensors(), dict(MIX, components=2)),
        "'1/mean/0.weight' is missing",
    ),
    "fewer components than saved": (
        lambda: _file(_two_runs(), MIX),
        "are not named by the metadata",
    ),
    "parameters not a list": (lambda: _file(_tensors(), dict(META, parameters={})), "'parameters'"),
    "no parameters": (lambda: _file({}, dict(META, parameters=[])), "'parameters' must name"),
    "a parameter named twice": (
        lambda: _file(_tensors(), dict(META, parameters=META["parameters"] * 2)),
        "'parameters' must name distinct",
    ),
    "a parameter outside the structure": (
        lambda: _file(_tensors(), dict(META, parameters=["head.weight"])),
        "['head.weight']",
    ),
    "a malformed structure": (
        lambda: _file(_tensors(), dict(META, structure=[["0.weight"]])),
        "'structure' is malformed",
    ),
    "the structure of another model": (
        lambda: _file(_tensors(), dict(META, structure=META["structure"][:2])),
        "does not match the posterior saved in",
    ),
    "a tensor missing": (
        lambda: _file({k: v for k, v in _tensors().items() if k != "0/std/2.bias"}, META),
        "'0/std/2.bias' is missing",
    ),
    "a tensor of another shape": (
        lambda: _file(_one("0/std/0.weight", torch.ones(2, 2).double()), META),
        "'0/std/0.weight' has shape (2, 2), expected (4, 3)",
    ),
    "an integer tensor": (
        lambda: _file(_one("0/std/0.weight", torch.ones(4, 3, dtype=torch.int64)), META),
        "'0/std/0.weight' is not a floating tensor",
    ),
    "NaN standard deviations": (lambda: _file(_tensors(NAN), META), "NaN or inf"),
    "inf standard deviations": (lambda: _file(_tensors(INF), META), "NaN or inf"),
    "negative standard deviations": (lambda: _file(_tensors(-1.0), META), "deviations >= 0"),
    "a NaN mean": (
        lambda: _file(_one("0/mean/0.weight", W.clone().fill_(NAN)), META),
        "'0/mean/0.weight' has 12 NaN or inf",
    ),
    "an inf mean": (
        lambda: _file(_one("0/mean/2.bias", torch.tensor([0.0, -INF]).double()), META),
        "'0/mean/2.bias' has 1 NaN or inf",
    ),
    "an unknown likelihood": (
        lambda: _file(_tensors(), dict(META, likelihood="poisson")),
        "saved settings are invalid: likelihood",
    ),
    "a likelihood of the wrong type": (
        lambda: _file(_tensors(), dict(META, likelihood=3)),
        "'likelihood' has the wrong type",
    ),
    "a negative sigma_noise": (
        lambda: _file(_tensors(), dict(META, sigma_noise=-1.0)),
        "saved settings are invalid: sigma_noise",
    ),
    "an infinite sigma_noise": (
        lambda: _file(_tensors(), dict(META, sigma_noise=math.inf)),
        "saved settings are invalid: sigma_noise",
    ),
    "a sigma_noise of the wrong type": (
        lambda: _file(_tensors(), dict(META, sigma_noise="1")),
        "'sigma_noise' has the wrong type",
    ),
}


def _old_file():
    """A file as 0.3 wrote it: its own metadata key and layout."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "x.safetensors"
        meta = {"format": "partialbayes.ivon.posterior", "version": 1, "kind": "GaussianPosterior"}
        save_file(_tensors(), str(path), metadata={"partialbayes.ivon": json.dumps(meta)})
        return path.read_bytes()


def _two_runs(std_value=0.1):
    second = {k.replace("0/", "1/", 1): v.clone() for k, v in _tensors(std_value).items()}
    return {**_tensors(), **second}


def _file_without_metadata():
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "x.safetensors"
        save_file(_tensors(), str(path))
        return path.read_bytes()


@pytest.mark.parametrize("what", CASES)
@pytest.mark.parametrize(
    "load", [load_posterior, GaussianPosterior.load, MultiIVON.load], ids=lambda f: f.__qualname__
)
def test_inconsistent_files(what, load):
    data, fragment = CASES[what]
    _load(data(), fragment, load)


def test_a_mixture_round_trip_still_checks_every_run(tmp_path):
    model = _model()
    post = load_posterior(_write(tmp_path, _file(_tensors(), META)), model)
    MultiIVON([post, post]).save(tmp_path / "mix.safetensors")
    assert len(load_posterior(tmp_path / "mix.safetensors", model).components) == 2
    bad = _write(tmp_path, _file(_two_runs(-0.5), dict(MIX, components=2)))
    with pytest.raises(ValueError, match=r"'1/std/0\.weight' is not a floating tensor of standard"):
        MultiIVON.load(bad, model)


def _write(tmp_path, data):
    path = tmp_path / "file.safetensors"
    path.write_bytes(data)
    return path
