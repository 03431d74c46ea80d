"""SGMCMCCallback in a real transformers.Trainer run on a tiny BERT, against run_chain on the same batches."""

import pytest
import torch
from torch.utils.data import IterableDataset

from partialbayes.selection import KronBlock, Subset
from partialbayes.sgmcmc import SGMCMC, SGMCMCCallback, run_chain

transformers = pytest.importorskip("transformers")

from tiny_models import tiny_model  # noqa: E402

SUBSET = {"bert.encoder.layer.0.output.dense.weight": KronBlock(rows=torch.arange(3)),
          "classifier.weight": KronBlock()}  # fmt: skip


def bert():
    return tiny_model("bert", seed=0, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


def data(n=16, length=6):
    g = torch.Generator().manual_seed(0)
    return [{"input_ids": torch.randint(1, 30, (length,), generator=g),
             "attention_mask": torch.ones(length, dtype=torch.long),
             "labels": torch.randint(0, 2, (), generator=g)} for _ in range(n)]  # fmt: skip


class InOrder(IterableDataset):
    def __init__(self, examples):
        self.examples = examples

    def __iter__(self):
        while True:
            yield from self.examples


def trainer(tmp_path, model, optimizer, callback, max_steps=8):
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=max_steps, per_device_train_batch_size=4,
        lr_scheduler_type="constant", max_grad_norm=0.0, report_to=[], use_cpu=True,
        save_strategy="no", logging_strategy="no", disable_tqdm=True,
    )  # fmt: skip
    return transformers.Trainer(
        model=model, args=args, train_dataset=InOrder(data()),
        data_collator=transformers.default_data_collator, optimizers=(optimizer, None),
        callbacks=[callback],
    )  # fmt: skip


def test_trainer_samples_what_run_chain_samples(tmp_path):
    model = bert()
    subset = Subset.from_model(model, SUBSET)
    kw = dict(lr=0.05, num_data=16, method="sghmc", burn_in=4, thin=2)
    sampler = SGMCMC(model, subset, generator=torch.Generator().manual_seed(3), **kw)
    callback = SGMCMCCallback()
    trainer(tmp_path, model, sampler, callback).train()
    post = callback.posterior
    assert post.model is model
    assert post.num_samples == 2
    ref_model = bert()
    batches = [transformers.default_data_collator(data()[i : i + 4]) for i in range(0, 16, 4)]
    ref = run_chain(
        ref_model.train(), Subset.from_model(ref_model, SUBSET), batches, n_steps=8, seed=3, **kw
    ).posterior()
    for n in subset.names:
        torch.testing.assert_close(post.samples[n], ref.samples[n], rtol=1e-5, atol=1e-6)
    probs = post.predict(batches[0])
    assert probs.shape == (4, 2)


def test_callback_refuses_another_optimizer_and_warns_without_samples(tmp_path):
    model = bert()
    with pytest.raises(TypeError, match="SGMCMC"):
        trainer(
            tmp_path, model, torch.optim.SGD(model.parameters(), lr=0.1), SGMCMCCallback()
        ).train()
    with pytest.raises(ValueError, match="not seen a training run"):
        SGMCMCCallback().posterior
    sampler = SGMCMC(model, Subset.from_model(model, SUBSET), lr=0.05, num_data=16, burn_in=100)
    callback = SGMCMCCallback()
    with pytest.warns(RuntimeWarning, match="no sample kept"):
        trainer(tmp_path, model, sampler, callback, max_steps=2).train()
    with pytest.raises(ValueError, match="no sample kept"):
        callback.posterior
