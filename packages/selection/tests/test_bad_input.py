"""Bad input to the public entry points and the JSON load path gets a clear error (issue #16)."""

import json
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from partialbayes.selection import (
    KronBlock,
    MaskBlock,
    Subset,
    countable_parameters,
    largest_magnitude,
    max_operator_norm,
    random_modules,
    random_parameters,
    sparse_kfac,
    summary,
)
from partialbayes.selection.internal import skfac_percent_for_target


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(7, 5)
        self.fc1 = nn.Linear(5, 4)
        self.norm = nn.LayerNorm(4)
        self.fc2 = nn.Linear(4, 3)


MODEL = Tiny()
SAVED = Subset.from_model(
    MODEL,
    {
        "fc1.weight": KronBlock([1, 2], [0, 3]),
        "fc1.bias": KronBlock([1, 2]),
        "fc2.weight": MaskBlock(torch.eye(3, 4, dtype=torch.bool)),
    },
).to_json()


def with_block(name, block):
    data = json.loads(SAVED)
    data["blocks"][name] = block
    return json.dumps(data)


# --- Subset.from_json: the cases ---------------------------------------------------------


def test_fractional_rows_are_refused_not_truncated():
    # Before the fix, rows [0.5, 1.7] silently became [0, 1].
    text = with_block("fc1.weight", {"type": "kron", "rows": [0.5, 1.7], "cols": None})
    with pytest.raises(TypeError, match=r"'rows' of block 'fc1.weight' must hold integers"):
        Subset.from_json(text, MODEL)


@pytest.mark.parametrize("key", ["rows", "cols"])
def test_missing_kron_keys_are_named(key):
    block = {"type": "kron", "rows": [0], "cols": [1]}
    del block[key]
    with pytest.raises(ValueError, match=f"block of 'fc1.weight' has no '{key}' key"):
        Subset.from_json(with_block("fc1.weight", block), MODEL)


@pytest.mark.parametrize("key", ["shape", "indices"])
def test_missing_mask_keys_are_named(key):
    block = {"type": "mask", "shape": [3, 4], "indices": [0]}
    del block[key]
    with pytest.raises(ValueError, match=f"block of 'fc2.weight' has no '{key}' key"):
        Subset.from_json(with_block("fc2.weight", block), MODEL)


def test_missing_or_mistyped_blocks():
    data = json.loads(SAVED)
    del data["blocks"]
    with pytest.raises(ValueError, match="no 'blocks' key"):
        Subset.from_json(json.dumps(data), MODEL)
    data["blocks"] = [["fc1.weight", {"type": "kron", "rows": None, "cols": None}]]
    with pytest.raises(TypeError, match="'blocks' must be an object"):
        Subset.from_json(json.dumps(data), MODEL)
    data["blocks"] = {"fc1.weight": ["kron", None, None]}
    with pytest.raises(TypeError, match=r"block of 'fc1\.weight' must be an object"):
        Subset.from_json(json.dumps(data), MODEL)


@pytest.mark.parametrize(
    ("block", "error", "match"),
    [
        ({"type": "kron", "rows": [-1], "cols": None}, ValueError, "'rows' .* negative index -1"),
        ({"type": "kron", "rows": None, "cols": [9]}, ValueError, "out of range"),
        ({"type": "kron", "rows": "0,1", "cols": None}, TypeError, "'rows' .* got a string"),
        ({"type": "kron", "rows": 3, "cols": None}, TypeError, "'rows' .* got a number"),
        ({"type": "kron", "rows": [True], "cols": None}, TypeError, "got a boolean"),
        ({"type": "kron", "rows": [[0]], "cols": None}, TypeError, "got an array"),
        ({"type": "kron", "rows": None, "cols": {"0": 1}}, TypeError, "'cols' .* got an object"),
        ({"type": "mask", "shape": [4, 5], "indices": [2.0]}, TypeError, "'indices' .* integers"),
        ({"type": "mask", "shape": [4, 5], "indices": [20]}, ValueError, "out of range"),
        ({"type": "mask", "shape": [4, 5], "indices": [-3]}, ValueError, "negative index"),
        ({"type": "mask", "shape": None, "indices": [0]}, TypeError, "'shape' .* got null"),
        ({"type": "mask", "shape": [4.5, 5], "indices": [0]}, TypeError, "'shape' .* integers"),
        ({"type": "dense"}, ValueError, "unknown type 'dense'"),
        ({"rows": None, "cols": None}, ValueError, "unknown type None"),
    ],
)
def test_bad_block_fields(block, error, match):
    with pytest.raises(error, match=match):
        Subset.from_json(with_block("fc1.weight", block), MODEL)


# --- Subset.from_json: truncated and garbage files -----------------------------------------------


@given(cut=st.integers(0, len(SAVED) - 1))
def test_every_truncation_of_a_saved_subset_is_refused(cut):
    with pytest.raises(ValueError, match="not valid JSON"):
        Subset.from_json(SAVED[:cut], MODEL)


@given(text=st.text(max_size=60))
def test_garbage_text_is_refused_with_a_value_error(text):
    with pytest.raises((ValueError, TypeError)):
        Subset.from_json(text, MODEL)


@given(
    data=st.recursive(
        st.none() | st.booleans() | st.integers() | st.text(max_size=5),
        lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=5), c, max_size=3),
        max_leaves=8,
    )
)
def test_valid_json_of_the_wrong_form_is_refused(data):
    with pytest.raises(ValueError, match="format"):
        Subset.from_json(json.dumps(data), MODEL)


@given(
    blocks=st.dictionaries(
        st.sampled_from(["fc1.weight", "fc1.bias", "fc2.weight", "norm.weight"]),
        st.dictionaries(
            st.sampled_from(["type", "rows", "cols", "shape", "indices"]),
            st.one_of(
                st.sampled_from(["kron", "mask"]),
                st.none(),
                st.lists(st.one_of(st.integers(-3, 30), st.floats(0, 5)), max_size=4),
                st.integers(-2, 5),
            ),
            max_size=5,
        ),
        max_size=3,
    )
)
def test_generated_block_contents_either_load_or_raise_clearly(blocks):
    text = json.dumps({"format": "partialbayes.selection.Subset", "version": 1, "blocks": blocks})
    try:
        s = Subset.from_json(text, MODEL)
    except (ValueError, TypeError):
        return  # a clear error; a raw KeyError / AttributeError / IndexError fails the test
    assert Subset.from_json(s.to_json(), MODEL) == s


def test_from_json_refuses_non_text():
    with pytest.raises(TypeError, match="text must be a JSON string"):
        Subset.from_json(json.loads(SAVED), MODEL)
    with pytest.raises(ValueError, match="not valid JSON"):
        Subset.from_json(b"\xff\xfe{", MODEL)


# --- KronBlock and the strategies --------------------------------------------------------------


@pytest.mark.parametrize("rows", [[0.5, 1.7], [True, 2], "01", 3, [[0, 1]]], ids=repr)
def test_kron_block_refuses_non_integer_indices(rows):
    with pytest.raises(TypeError, match="KronBlock rows must be a sequence of ints"):
        KronBlock(rows)


BAD_PERCENTS = st.one_of(
    st.sampled_from([0, -1, 100.5, math.nan, math.inf, -math.inf]),
    st.floats(max_value=0, allow_nan=False, allow_infinity=False),
    st.floats(min_value=100.0001, allow_infinity=False),
)


@given(percent=BAD_PERCENTS)
def test_percent_outside_the_interval(percent):
    for fn in (largest_magnitude, random_parameters, sparse_kfac):
        with pytest.raises(ValueError, match=r"percent must be in \(0, 100\]"):
            fn(MODEL, percent)


@pytest.mark.parametrize("percent", [True, "10", None])
def test_percent_of_the_wrong_type(percent):
    for fn in (largest_magnitude, random_parameters, sparse_kfac):
        with pytest.raises(TypeError, match="percent must be a number"):
            fn(MODEL, percent)


@pytest.mark.parametrize(("k", "error"), [(True, TypeError), (1.0, TypeError), (-1, ValueError)])
def test_module_counts(k, error):
    with pytest.raises(error, match="k must be"):
        max_operator_norm(MODEL, k, group="all")
    with pytest.raises(error, match="k must be"):
        random_modules(MODEL, k)


def test_other_bad_arguments():
    with pytest.raises(TypeError, match=r"seed must be an int or torch\.Generator"):
        random_modules(MODEL, 1, seed=1.5)
    with pytest.raises(TypeError, match="exclude must be"):
        countable_parameters(MODEL, exclude=5)
    with pytest.raises(ValueError, match="exclude pattern '\\(' is not a valid regex"):
        largest_magnitude(MODEL, 10, exclude=["("])
    with pytest.raises(TypeError, match=r"model must be a torch\.nn\.Module"):
        countable_parameters("model")
    for tol in (math.nan, 0.0, -1.0):
        with pytest.raises(ValueError, match=r"tol must be in \(0, inf\]"):
            skfac_percent_for_target(MODEL, 5.0, tol=tol)
    with pytest.raises(TypeError, match="tol must be a number"):
        skfac_percent_for_target(MODEL, 5.0, tol=True)
    with pytest.raises(TypeError, match=r"subset must be a partialbayes\.selection\.Subset"):
        summary("fc1")
    with pytest.raises(TypeError, match="parameter name must be a string"):
        Subset.from_json(SAVED, MODEL).num_entries(3)
