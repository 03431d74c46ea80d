from collections import Counter

import pytest
import torch

from partialbayes.glue_bench.data_glue import (
    TASKS,
    encode,
    load_glue,
    read_glue_tsv,
    split_indices,
    task_spec,
)
from partialbayes.glue_bench.data_uci import load_uci, read_uci_matrix

# ---------------------------------------------------------------- GLUE readers


def test_quoting_off_keeps_rows_that_start_with_a_quote(tmp_path):
    # With csv's default quoting the second row would swallow the third line.
    path = tmp_path / "train.tsv"
    path.write_text(
        "\ufeffQuality\t#1 ID\t#2 ID\t#1 String\t#2 String\n"
        '1\t1\t2\tHe said " hi\t" The thing " is\n'
        "0\t3\t4\tplain\tother plain\n"
        '1\t5\t6\t"quoted start\tend"\n'
    )
    ex = read_glue_tsv(path, task_spec("mrpc"))
    assert len(ex) == 3
    assert ex.labels == (1, 0, 1)
    assert ex.texts[0] == ('He said " hi', '" The thing " is')
    assert ex.texts[2] == ('"quoted start', 'end"')


def test_bom_header_is_recognised(tmp_path):
    path = tmp_path / "dev.tsv"
    path.write_text("\ufeffQuality\t#1 ID\t#2 ID\t#1 String\t#2 String\n0\t1\t2\ta\tb\n")
    assert read_glue_tsv(path, task_spec("mrpc")).labels == (0,)


def test_malformed_row_names_line_number(tmp_path):
    path = tmp_path / "train.tsv"
    path.write_text("sentence\tlabel\ngood\t1\nbad row without tab\nok\t0\n")
    with pytest.raises(ValueError, match=r"line 3: expected 2 tab-separated fields, got 1"):
        read_glue_tsv(path, task_spec("sst2"))


def test_unknown_label_names_line(tmp_path):
    path = tmp_path / "train.tsv"
    path.write_text("index\tsentence1\tsentence2\tlabel\n0\ta\tb\tentailment\n1\ta\tb\tmaybe\n")
    with pytest.raises(ValueError, match=r"line 3: label 'maybe'"):
        read_glue_tsv(path, task_spec("rte"))


def test_trailing_empty_lines_are_skipped(tmp_path):
    path = tmp_path / "train.tsv"
    path.write_text("sentence\tlabel\na\t1\n\n\n")
    assert len(read_glue_tsv(path, task_spec("sst2"))) == 1


def test_missing_file_is_named(tmp_path):
    (tmp_path / "RTE").mkdir()
    (tmp_path / "RTE" / "train.tsv").write_text("index\tsentence1\tsentence2\tlabel\n")
    with pytest.raises(FileNotFoundError, match=r"RTE/dev\.tsv"):
        load_glue("rte", tmp_path)


def test_unknown_task_lists_valid_ones():
    with pytest.raises(ValueError, match=r"unknown GLUE task 'cola'; valid tasks: sst2, mrpc, rte"):
        task_spec("cola")


def test_no_data_message_says_where(monkeypatch, tmp_path):
    monkeypatch.setenv("PARTIALBAYES_DATA", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FileNotFoundError, match=r"--glue-dir"):
        load_glue("sst2")


# ---------------------------------------------------------------- splits


@pytest.mark.parametrize("task", list(TASKS))
def test_paper_split_sizes(task):
    spec = TASKS[task]
    n = {"sst2": 67_349, "mrpc": 3_668, "rte": 2_490}[task]
    train, val = split_indices(n, spec, split=0)
    assert len(val) == spec.val_size
    assert len(train) == min(spec.train_size, n - spec.val_size)
    assert not set(train) & set(val)
    assert max(train + val) < n


def test_splits_are_seeded_and_differ():
    spec = TASKS["rte"]
    assert split_indices(2490, spec, 1) == split_indices(2490, spec, 1)
    assert split_indices(2490, spec, 1) != split_indices(2490, spec, 2)


def test_max_train_caps_and_scales_validation():
    spec = TASKS["sst2"]
    train, val = split_indices(67_349, spec, 0, max_train=1000)
    assert len(train) == 1000
    assert len(val) == round(1000 * 6700 / 60600)
    full_train, full_val = split_indices(67_349, spec, 0)
    assert val == full_val[: len(val)]
    assert train == full_train[:1000]
    with pytest.raises(ValueError, match="max_train"):
        split_indices(100, spec, 0, max_train=0)


def test_encode_batches(tiny_tokenizer, tmp_path):
    path = tmp_path / "train.tsv"
    path.write_text(
        "index\tsentence1\tsentence2\tlabel\n0\ta b c\td e\tentailment\n1\tx\ty z\tnot_entailment\n2\tq\tr\tentailment\n"
    )
    ex = read_glue_tsv(path, task_spec("rte"))
    batches = encode(ex, tiny_tokenizer, batch_size=2, max_length=16)
    assert [len(b["labels"]) for b in batches] == [2, 1]
    assert batches[0]["labels"].tolist() == [0, 1]
    assert batches[0]["input_ids"].shape == batches[0]["attention_mask"].shape
    # pairs are joined with [SEP] and use token type 1 for the second text
    assert (batches[0]["token_type_ids"][0] == 1).any()


# ---------------------------------------------------------------- real files

REAL = {
    "sst2": (67_349, 872, {1: 37_569, 0: 29_780}, {1: 444, 0: 428}),
    "mrpc": (3_668, 408, {1: 2_474, 0: 1_194}, {1: 279, 0: 129}),
    "rte": (2_490, 277, {0: 1_249, 1: 1_241}, {0: 146, 1: 131}),
}


@pytest.mark.data
@pytest.mark.parametrize("task", list(REAL))
def test_real_glue_counts_and_labels(task, data_dir):
    train, test = load_glue(task, data_dir / "glue")
    n_train, n_test, c_train, c_test = REAL[task]
    assert (len(train), len(test)) == (n_train, n_test)
    assert dict(Counter(train.labels)) == c_train
    assert dict(Counter(test.labels)) == c_test


@pytest.mark.data
def test_real_mrpc_rows_starting_with_quote(data_dir):
    train, _ = load_glue("mrpc", data_dir / "glue")
    starts = sum(t.startswith('"') for pair in train.texts for t in pair)
    assert starts == 687


# ---------------------------------------------------------------- UCI


def test_uci_reader_rejects_ragged_rows(tmp_path):
    path = tmp_path / "data.txt"
    path.write_text("1 2 3\n4 5\n")
    with pytest.raises(ValueError, match="line 2: 2 columns, expected 3"):
        read_uci_matrix(path)


def test_uci_unknown_dataset():
    with pytest.raises(ValueError, match="valid datasets: boston, energy, yacht"):
        load_uci("wine", 0, "/nonexistent")


@pytest.mark.data
@pytest.mark.parametrize(
    ("name", "n_train", "n_test", "d"),
    [("boston", 455, 51, 13), ("energy", 691, 77, 8), ("yacht", 277, 31, 6)],
)
def test_real_uci_split(name, n_train, n_test, d, data_dir):
    s = load_uci(name, 3, data_dir / "uci")
    assert s.x_train.shape == (n_train, d)
    assert s.x_test.shape == (n_test, d)
    torch.testing.assert_close(
        s.x_train.mean(0), torch.zeros(d, dtype=torch.float64), atol=1e-10, rtol=0
    )
    torch.testing.assert_close(float(s.y_train.std()), 1.0)
    assert torch.isfinite(s.x_test).all()
    with pytest.raises(ValueError, match=r"split must lie in \[0, 20\), got 20"):
        load_uci(name, 20, data_dir / "uci")


@pytest.mark.data
def test_uci_validation_part(data_dir):
    """20 % of the training rows become validation rows; standardisation uses the rest only."""
    full = load_uci("boston", 2, data_dir / "uci")
    s = load_uci("boston", 2, data_dir / "uci", val_fraction=0.2, seed=5)
    assert s.x_val.shape == (91, 13)
    assert s.x_train.shape == (364, 13)
    torch.testing.assert_close(
        s.x_train.mean(0), torch.zeros(13, dtype=torch.float64), atol=1e-10, rtol=0
    )
    # the same rows as the full training part, re-standardised: train + val = the split's training rows
    raw = torch.cat([s.y_train, s.y_val]) * s.y_std + s.y_mean
    raw_full = full.y_train * full.y_std + full.y_mean
    torch.testing.assert_close(raw.sort().values, raw_full.sort().values)
    torch.testing.assert_close(
        s.y_test * s.y_std + s.y_mean, full.y_test * full.y_std + full.y_mean
    )
    again = load_uci("boston", 2, data_dir / "uci", val_fraction=0.2, seed=5)
    torch.testing.assert_close(again.y_val, s.y_val)
    with pytest.raises(ValueError, match=r"val_fraction must lie in \[0, 0.5\], got 0.9"):
        load_uci("boston", 2, data_dir / "uci", val_fraction=0.9)
