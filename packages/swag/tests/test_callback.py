"""SWAGCallback in a real transformers.Trainer run on a tiny BERT, against collect_swag (issue #25)."""

import pytest
import torch
from torch.utils.data import IterableDataset

from partialbayes.selection import KronBlock, Subset
from partialbayes.swag import SWAGCallback, collect_swag

transformers = pytest.importorskip("transformers")

from tiny_models import tiny_model  # noqa: E402

SUBSET = {
    "bert.encoder.layer.0.output.dense.weight": KronBlock(),
    "classifier.weight": KronBlock(),
}


def no_dropout_bert():
    return tiny_model("bert", seed=0, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


def data(n=16, length=6):
    g = torch.Generator().manual_seed(0)
    return [
        {
            "input_ids": torch.randint(1, 30, (length,), generator=g),
            "attention_mask": torch.ones(length, dtype=torch.long),
            "labels": torch.randint(0, 2, (), generator=g),
        }
        for _ in range(n)
    ]


class InOrder(IterableDataset):
    """The examples again and again, unshuffled (so Trainer's batches are the ones given to collect_swag)."""

    def __init__(self, examples):
        self.examples = examples

    def __iter__(self):
        while True:
            yield from self.examples


def train(tmp_path, callback, *, max_steps=8, lr=0.05, model=None):
    model = no_dropout_bert() if model is None else model
    subset = Subset.from_model(model, SUBSET)
    opt = torch.optim.SGD(
        [p for n, p in model.named_parameters() if n in subset.names], lr=lr, momentum=0.9
    )
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=max_steps, per_device_train_batch_size=4,
        lr_scheduler_type="constant", max_grad_norm=0.0, report_to=[], use_cpu=True,
        save_strategy="no", logging_strategy="no", disable_tqdm=True,
    )  # fmt: skip
    trainer = transformers.Trainer(
        model=model, args=args, train_dataset=InOrder(data()),
        data_collator=transformers.default_data_collator, optimizers=(opt, None),
        callbacks=[callback],
    )  # fmt: skip
    trainer.train()
    return model


@pytest.mark.parametrize("diagonal_only", [False, True])
def test_trainer_with_the_callback_collects_what_collect_swag_collects(tmp_path, diagonal_only):
    # Trainer's SGD with momentum on the subset's tensors at a constant rate, in the same batch order, is
    # collect_swag's loop: the moments must agree to float32 round-off.
    model = no_dropout_bert()
    callback = SWAGCallback(
        Subset.from_model(model, SUBSET), every=2, max_rank=3, diagonal_only=diagonal_only
    )
    train(tmp_path, callback, model=model)
    post = callback.posterior
    assert post.model is model
    assert callback.n_snapshots == post.n_snapshots == 4
    ref_model = no_dropout_bert()
    batches = [transformers.default_data_collator(data()[i : i + 4]) for i in range(0, 16, 4)]
    ref = collect_swag(ref_model, Subset.from_model(ref_model, SUBSET), batches, lr=0.05,
                       n_steps=8, snapshot_every=2, max_rank=3, diagonal_only=diagonal_only,
                       progress=False)  # fmt: skip
    torch.testing.assert_close(post.mean, ref.mean, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(post.variance, ref.variance, rtol=1e-4, atol=1e-9)
    if not diagonal_only:
        torch.testing.assert_close(post.deviations, ref.deviations, rtol=1e-4, atol=1e-7)
    x = batches[0]
    g1, g2 = (torch.Generator().manual_seed(0) for _ in range(2))
    with torch.no_grad():  # the posterior predicts on the trained model
        assert post.predict(x, n_samples=3, generator=g1).shape == (4, 2)
        assert ref.predict(x, n_samples=3, generator=g2).shape == (4, 2)


def test_snapshots_start_after_start_step_every_every_steps(tmp_path):
    model = no_dropout_bert()
    subset = Subset.from_model(model, SUBSET)
    taken = []

    class Spy(SWAGCallback):
        def on_step_end(self, args, state, control, **kwargs):
            before = self.n_snapshots
            super().on_step_end(args, state, control, **kwargs)
            if self.n_snapshots > before:
                taken.append(state.global_step)

    train(tmp_path, Spy(subset, start_step=3, every=2, max_rank=2), max_steps=10, model=model)
    assert taken == [5, 7, 9]


def test_start_step_past_max_steps_warns_at_train_end_and_posterior_refuses(tmp_path):
    model = no_dropout_bert()
    callback = SWAGCallback(Subset.from_model(model, SUBSET), start_step=20, every=2)
    with pytest.warns(RuntimeWarning, match=r"collected 0 snapshot\(s\) in 4 optimizer steps"):
        train(tmp_path, callback, max_steps=4, model=model)
    with pytest.raises(ValueError, match=r"collected 0 snapshot\(s\).*needs at least 2"):
        callback.posterior


def test_one_snapshot_is_enough_for_swag_diag_only(tmp_path):
    model = no_dropout_bert()
    low_rank = SWAGCallback(Subset.from_model(model, SUBSET), start_step=2, every=2)
    with pytest.warns(RuntimeWarning, match=r"collected 1 snapshot\(s\)"):
        train(tmp_path, low_rank, max_steps=4, model=model)
    with pytest.raises(ValueError, match="needs at least 2"):
        low_rank.posterior
    model = no_dropout_bert()
    diag = SWAGCallback(Subset.from_model(model, SUBSET), start_step=2, every=2, diagonal_only=True)
    train(tmp_path, diag, max_steps=4, model=model)
    assert diag.posterior.n_snapshots == 1


def test_bad_input(tmp_path):
    model = no_dropout_bert()
    subset = Subset.from_model(model, SUBSET)
    with pytest.raises(TypeError, match="Subset"):
        SWAGCallback({"classifier.weight": None})
    with pytest.raises(ValueError, match="start_step must be an int >= 0"):
        SWAGCallback(subset, start_step=-1)
    with pytest.raises(ValueError, match="every must be a positive int"):
        SWAGCallback(subset, every=0)
    with pytest.raises(TypeError, match="every must be an int"):
        SWAGCallback(subset, every=2.0)
    with pytest.raises(ValueError, match="has not seen a training run"):
        SWAGCallback(subset).posterior
    with pytest.raises(ValueError, match="max_rank must be >= 2"):  # SWAG's options, at train begin
        train(tmp_path, SWAGCallback(subset, max_rank=1), max_steps=2, model=model)
    callback = SWAGCallback(subset)
    assert callback.on_some_future_event(None, None, None, model=model) is None
    with pytest.raises(AttributeError, match="no attribute 'posterior_'"):
        callback.posterior_
