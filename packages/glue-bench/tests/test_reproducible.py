"""Two fresh processes with the same settings write bit-identical checkpoints, factors and records."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import tiny_models
from partialbayes.glue_bench.store import TIMING_FIELDS, without_timings

SCRIPT = textwrap.dedent(
    """
    import string, sys
    from pathlib import Path

    import torch
    from transformers import BertTokenizerFast

    from partialbayes.glue_bench import Grid, RunConfig, Settings, TrainConfig, run_grid
    from partialbayes.glue_bench.linearised import LinearSamplingConfig

    glue, out = Path(sys.argv[1]), Path(sys.argv[2])
    sys.path.insert(0, sys.argv[3])
    from tiny_models import tiny_model
    torch.set_num_threads(1)
    chars = list(string.ascii_lowercase + string.digits + string.punctuation)
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *chars, *[f"##{c}" for c in chars]]
    (out / "vocab.txt").parent.mkdir(parents=True, exist_ok=True)
    (out / "vocab.txt").write_text("\\n".join(vocab) + "\\n")
    tokenizer = BertTokenizerFast(vocab=str(out / "vocab.txt"), do_lower_case=True)

    def factory(name, num_labels, dropout):
        # no seeding here: the random weights (the "new head") must be seeded by the run itself
        model = tiny_model(
            "bert", size="s", vocab=tokenizer.vocab_size, positions=64, num_labels=num_labels,
            hidden_dropout_prob=dropout,
        )
        return model, tokenizer

    settings = Settings(
        n_samples=3, swag_lrs=(1e-2,), swag_steps=10, module_counts=(1, 2),
        skfac_percents=(10.0, 50.0), fisher="mc",
        linear_sampling=LinearSamplingConfig(k=2, em_iters=1, samples=3, cg_iters=3),
    )
    common = dict(model="tiny", settings=settings, max_train_examples=32, curvature_batch_size=8)
    train = dict(epochs=2, batch_size=8, max_length=32, patience=2, lr=1e-3)
    methods = ["temperature", "last-layer", "skfac", "kfac-random", "swag-random", "ls-random"]
    run_grid(Grid(["sst2"], [1], methods, RunConfig(train=TrainConfig(**train), **common),
                  out / "adamw", glue_dir=glue, model_factory=factory, progress=False))
    ivon = TrainConfig(**train, optimizer="ivon", ivon_lr=0.05)
    run_grid(Grid(["sst2"], [0], ["map", "ivon"], RunConfig(train=ivon, **common),
                  out / "ivon", glue_dir=glue, model_factory=factory, progress=False))
    """
)


def _snapshot(root: Path) -> dict[str, object]:
    """Every file of a results folder: JSON without its timing fields, other files as bytes."""
    out: dict[str, object] = {}
    for path in sorted(root.rglob("*")):
        if path.is_dir() or path.name == "vocab.txt":
            continue
        rel = str(path.relative_to(root))
        if path.suffix == ".json":
            out[rel] = without_timings(json.loads(path.read_text()))
        else:
            out[rel] = path.read_bytes()
    return out


def test_two_fresh_processes_give_identical_results(tmp_path, mini_glue):
    pytest.importorskip("partialbayes.ivon")
    script = tmp_path / "grid.py"
    script.write_text(SCRIPT)
    runs = []
    for k in range(2):
        out = tmp_path / f"run{k}"
        subprocess.run(
            [
                sys.executable,
                str(script),
                str(mini_glue),
                str(out),
                str(Path(tiny_models.__file__).parent),
            ],
            check=True,
            timeout=600,
        )
        runs.append(_snapshot(out))
    first, second = runs
    assert first.keys() == second.keys()
    names = sorted(first)
    # what was compared: checkpoints, IVON Hessians, records, configuration, data (no curvature is stored)
    assert sum(n.endswith("model.safetensors") for n in names) == 2
    assert any(n.endswith("ivon_hess.safetensors") for n in names)
    assert not any("/curvature/" in n for n in names)
    assert sum("records/" in n for n in names) == (1 + 1 + 2 + 2 + 2 + 2) + 2
    differing = [n for n in names if first[n] != second[n]]
    assert differing == []
    # the timing fields are the only ones left out, and they are there
    record = json.loads(
        next((tmp_path / "run0" / "adamw" / "records").rglob("skfac/10.json")).read_text()
    )
    assert {"fit_seconds", "predict_seconds", "cpu_seconds", "seconds"} <= set(
        record
    ) & TIMING_FIELDS
