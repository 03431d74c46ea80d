"""Fine-tuning killed between epochs resumes from its progress file, bit for bit."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys

import pytest
import torch

from partialbayes.glue_bench.data_glue import Examples
from partialbayes.glue_bench.store import progress_epoch
from partialbayes.glue_bench.train import TrainConfig, finetune, logger


class Killed(BaseException):
    """Stands for the process being killed (not an ``Exception``: nothing may catch it)."""


def _examples(n: int, offset: int = 0) -> Examples:
    words = ("good", "bad", "fine", "dull")
    texts = tuple((f"the film {words[(i + offset) % 4]} {i}",) for i in range(n))
    return Examples(texts, tuple((i + offset) % 2 for i in range(n)))


class _Lines(logging.Handler):
    """Fine-tuning's log lines; "killed" (``Killed`` raised out of the logging call) after an epoch."""

    def __init__(self, kill_after: int | None) -> None:
        super().__init__()
        self.lines: list[str] = []
        self.kill_after = kill_after

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(line := record.getMessage())
        if self.kill_after is not None and line.startswith(f"epoch {self.kill_after}/"):
            raise Killed


def _run(factory, config, resume=None, kill_after=None):
    model, tokenizer = factory()
    handler, level = _Lines(kill_after), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        args = (_examples(24), _examples(8, 1), config, "cpu", False, resume)
        summary = finetune(model, tokenizer, *args)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    return model, summary, handler.lines


@pytest.mark.parametrize("optimizer", ["adamw", "ivon"])
def test_a_killed_finetune_resumes_bit_for_bit(tiny_bert_factory, tmp_path, optimizer):
    config = TrainConfig(epochs=4, batch_size=4, max_length=16, lr=1e-3, patience=4, seed=3)
    config = TrainConfig(**{**config.__dict__, "optimizer": optimizer, "dropout": 0.3})
    whole, expected, _ = _run(tiny_bert_factory, config)
    path = tmp_path / "ckpt.progress.safetensors"
    with pytest.raises(Killed):
        _run(tiny_bert_factory, config, path, kill_after=2)
    assert progress_epoch(path) == (2, 4)
    torch.manual_seed(12345)  # a new process: the global RNG is elsewhere
    resumed, summary, lines = _run(tiny_bert_factory, config, path)
    assert lines[0].startswith("resuming after epoch 2/4")
    assert summary["history"] == expected["history"]
    assert summary["best_epoch"] == expected["best_epoch"]
    for (name, a), b in zip(whole.state_dict().items(), resumed.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    if optimizer == "ivon":
        for name, h in expected["ivon_hess"].items():
            assert torch.equal(h, summary["ivon_hess"][name]), name


def test_progress_of_other_settings_is_refused(tiny_bert_factory, tmp_path):
    config = TrainConfig(epochs=2, batch_size=4, max_length=16, lr=1e-3, patience=4)
    path = tmp_path / "p.safetensors"
    with pytest.raises(Killed):
        _run(tiny_bert_factory, config, path, kill_after=1)
    other = TrainConfig(epochs=2, batch_size=4, max_length=16, lr=2e-3, patience=4)
    with pytest.raises(ValueError, match=r"other fine-tuning settings\); delete it"):
        _run(tiny_bert_factory, other, path)
    path.write_bytes(b"garbage")
    with pytest.raises(ValueError, match="cannot be read"):
        _run(tiny_bert_factory, config, path)
    assert progress_epoch(path) is None


SCRIPT = """
import logging, sys, time
from pathlib import Path
import torch
from conftest import _build_tokenizer
from test_resume import _examples
from tiny_models import tiny_model
from partialbayes.glue_bench.train import TrainConfig, finetune, logger
torch.set_num_threads(1)
tok = _build_tokenizer(Path({folder!r}))
model = tiny_model("bert", size="s", vocab=tok.vocab_size, positions=64, num_labels=2, seed=0)
config = TrainConfig(epochs=3, batch_size=4, max_length=16, lr=1e-3, patience=4)
def log(record):  # a logger filter: print each line, then sleep after the first epoch
    print(record.getMessage(), flush=True)
    if {slow} and record.getMessage().startswith("epoch 1/"):
        time.sleep(60)
    return True
logging.getLogger("partialbayes.glue_bench.train").addFilter(log)
logging.getLogger("partialbayes.glue_bench").setLevel(logging.INFO)
finetune(model, tok, _examples(24), _examples(8, 1), config, "cpu", False, Path({path!r}))
torch.save(model.state_dict(), {out!r})
"""


@pytest.mark.slow
def test_sigkill_between_epochs_resumes_bit_for_bit(tmp_path):
    """A real ``SIGKILL`` after the first epoch's progress file; the rerun equals an unkilled run."""
    tests = os.path.dirname(__file__)
    root = os.path.dirname(os.path.dirname(os.path.dirname(tests)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([tests, root])}

    def script(slow: bool, name: str) -> list[str]:
        path, out = str(tmp_path / f"{name}.p"), str(tmp_path / f"{name}.pt")
        code = SCRIPT.format(folder=str(tmp_path), slow=slow, path=path, out=out)
        return [sys.executable, "-c", code]

    subprocess.run(script(False, "a"), env=env, check=True, cwd=tests)
    proc = subprocess.Popen(
        script(True, "b"), env=env, stdout=subprocess.PIPE, text=True, cwd=tests
    )
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("epoch 1/"):
            break
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert progress_epoch(tmp_path / "b.p") == (1, 3)
    subprocess.run(script(False, "b"), env=env, check=True, cwd=tests)
    a, b = torch.load(tmp_path / "a.pt"), torch.load(tmp_path / "b.pt")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_report_says_which_units_are_done_running_or_partial(tiny_bert_factory, tmp_path):
    from partialbayes.glue_bench.store import unit_states

    ckpt = tmp_path / "checkpoints" / "mrpc" / "split1" / "minilm-abc.progress.safetensors"
    ckpt.parent.mkdir(parents=True)
    config = TrainConfig(epochs=3, batch_size=4, max_length=16, lr=1e-3, patience=4)
    with pytest.raises(Killed):
        _run(tiny_bert_factory, config, ckpt, kill_after=1)
    done = tmp_path / "checkpoints" / "mrpc" / "split0" / "minilm-abc"
    done.mkdir(parents=True)
    (done / "meta.json").write_text('{"best_epoch": 2, "history": [{}, {}, {}]}')
    for split, name in ((0, "map"), (0, "temperature"), (2, "map")):
        rec = tmp_path / "records" / "mrpc" / f"split{split}" / name / "-.json"
        rec.parent.mkdir(parents=True)
        rec.write_text("{}")
    (tmp_path / "claims").mkdir()
    (tmp_path / "claims" / "mrpc-split2.json").write_text("{}")
    assert unit_states(tmp_path) == [
        {"task": "mrpc", "split": 0, "records": 2, "map": "epoch 2 of 3", "state": "done"},
        {
            "task": "mrpc",
            "split": 1,
            "records": 0,
            "map": "fine-tuning: 1/3 epochs",
            "state": "partial",
        },
        {"task": "mrpc", "split": 2, "records": 1, "map": "-", "state": "running"},
    ]
