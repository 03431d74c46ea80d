"""The IVON posterior load path with truncated, garbage and inconsistent files (issue #16).

Expected: a ``ValueError`` that names the file (never a raw ``SafetensorError`` / ``JSONDecodeError`` /
``KeyError``), and no posterior with NaN or negative standard deviations. ``load_posterior`` lives in
``_io.py``, which another work stream owns; the cases it fails today are marked ``xfail(strict=True)`` so that
they turn into failures (remove the mark) as soon as the loader is fixed.
"""

import json
import os
import re
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import Phase, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from partialbayes.ivon import IVON, ivon_posterior, load_posterior, save_posterior

#: Hypothesis without shrinking: the failing cases are expected until the loader is fixed (shrinking is slow).
NO_SHRINK = settings(phases=[Phase.explicit, Phase.reuse, Phase.generate])
IO_DEFECT = pytest.mark.xfail(
    strict=True,
    reason="_io.load_posterior defect (owned by another work stream): raw error or silent load",
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
        save_posterior(ivon_posterior(opt, model), path)
        return path.read_bytes(), {n: p.detach().clone() for n, p in model.named_parameters()}


RAW, MEANS = _saved_bytes()
META = {
    "format": "partialbayes.ivon.posterior",
    "version": 1,
    "kind": "GaussianPosterior",
    "components": 1,
    "parameters": [[n, list(t.shape), str(t.dtype)] for n, t in MEANS.items()],
}


def _load(data: bytes):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "bad.safetensors"
        path.write_bytes(data)
        with pytest.raises(ValueError, match=re.escape(str(path))):
            load_posterior(path, _model())


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


@IO_DEFECT
@NO_SHRINK
@given(length=st.integers(0, len(RAW) - 1))
def test_truncated_files(length):
    _load(RAW[:length])


@IO_DEFECT
@NO_SHRINK
@given(data=st.binary(max_size=300))
def test_garbage_files(data):
    _load(data)


@IO_DEFECT
@NO_SHRINK
@given(data=st.binary(min_size=1, max_size=64), at=st.integers(8, len(RAW) - 1))
def test_files_with_overwritten_bytes_in_the_header(data, at):
    header_end = 8 + int.from_bytes(RAW[:8], "little")
    at = min(at, header_end - 1)
    _load(RAW[:at] + data + RAW[at + len(data) :])


def test_missing_file_names_the_path():
    path = Path(tempfile.gettempdir()) / f"no-such-ivon-posterior-{os.getpid()}.safetensors"
    with pytest.raises(FileNotFoundError, match=re.escape(path.name)):
        load_posterior(path, _model())


@pytest.mark.parametrize(
    ("what", "data"),
    [
        pytest.param(
            "metadata that is not JSON", lambda: _file(_tensors(), "{not json"), marks=IO_DEFECT
        ),
        pytest.param(
            "metadata without 'parameters'",
            lambda: _file(_tensors(), {k: v for k, v in META.items() if k != "parameters"}),
            marks=IO_DEFECT,
        ),
        pytest.param(
            "a tensor missing",
            lambda: _file({k: v for k, v in _tensors().items() if k != "0/std/2.bias"}, META),
            marks=IO_DEFECT,
        ),
        pytest.param(
            "more components than saved",
            lambda: _file(_tensors(), dict(META, components=2)),
            marks=IO_DEFECT,
        ),
        pytest.param(
            "a tensor of another shape",
            lambda: _file(dict(_tensors(), **{"0/std/0.weight": torch.ones(2, 2).double()}), META),
            marks=IO_DEFECT,
        ),
        pytest.param(
            "NaN standard deviations", lambda: _file(_tensors(float("nan")), META), marks=IO_DEFECT
        ),
        pytest.param(
            "negative standard deviations", lambda: _file(_tensors(-1.0), META), marks=IO_DEFECT
        ),
        ("another format", lambda: _file(_tensors(), dict(META, format="something else"))),
        ("another version", lambda: _file(_tensors(), dict(META, version=99))),
    ],
)
def test_inconsistent_files(what, data):
    _load(data())
