"""IVON as the optimizer of a real Hugging Face Trainer (issue #25): IVONCallback against the plain loop."""

import pytest
import torch

from partialbayes.ivon import IVON, IVONCallback, ivon_posterior
from tiny_models import tiny_model

transformers = pytest.importorskip("transformers")

HYPER = dict(lr=0.05, ess=32.0, hess_init=0.5, beta2=0.999)


def _bert():
    return tiny_model(
        "bert", seed=0, size="s", hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0
    )


def _examples(n=32, length=12):
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        mask = torch.ones(length, dtype=torch.long)
        mask[length - i % 4 :] = 0  # some padding
        out.append(
            {
                "input_ids": torch.randint(5, 50, (length,), generator=g),
                "attention_mask": mask,
                "labels": torch.tensor(int(torch.randint(2, (1,), generator=g))),
            }
        )
    return out


def _args(tmp_path, **kw):
    base = dict(
        output_dir=str(tmp_path), per_device_train_batch_size=4, gradient_accumulation_steps=2,
        num_train_epochs=2, max_grad_norm=1.5, lr_scheduler_type="constant", use_cpu=True,
        report_to=[], save_strategy="no", logging_strategy="no", train_sampling_strategy="sequential",
        disable_tqdm=True, seed=0,
    )  # fmt: skip
    return transformers.TrainingArguments(**{**base, **kw})


def _trainer(tmp_path, model, optimizer, callbacks=(IVONCallback,), **kw):
    return transformers.Trainer(
        model=model, args=_args(tmp_path, **kw), train_dataset=_examples(),
        optimizers=(optimizer, None), callbacks=[c() for c in callbacks],
    )  # fmt: skip


def test_trainer_mean_equals_the_plain_loop_mean(tmp_path):
    """Accumulation of 2 micro-batches is one sample and one step; clipping acts on the sample's gradient.

    Both matter here: without the loop's clipping, or with another loss scale, the means differ by 1e-2
    (the tolerance is 1e-5; measured: equal to the bit). The loop's loss is the Trainer's: transformers 5
    passes ``num_items_in_batch`` to models that accept loss kwargs and then does not divide by the
    accumulation steps (BERT's classification loss stays the mean over its micro-batch); otherwise it divides.
    """
    model = _bert()
    opt = IVON(model.parameters(), generator=torch.Generator().manual_seed(0), **HYPER)
    trainer = _trainer(tmp_path, model, opt)
    trainer.train()
    assert opt.current_step == 2 * 32 // 8
    scale = 1 if trainer.model_accepts_loss_kwargs else 2

    ref = _bert()
    ref_opt = IVON(ref.parameters(), generator=torch.Generator().manual_seed(0), **HYPER)
    batches = list(
        torch.utils.data.DataLoader(
            _examples(), batch_size=4, collate_fn=transformers.default_data_collator
        )
    )
    for _epoch in range(2):
        for i in range(0, len(batches), 2):
            with ref_opt.sampled_params(train=True):
                for batch in batches[i : i + 2]:
                    (ref(**batch).loss / scale).backward()
                torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.5)  # binds in 5 of 8 steps
            ref_opt.step()
            ref_opt.zero_grad()
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6, msg=name)
        assert not torch.equal(p.detach(), _bert().get_parameter(name).detach()) or "pooler" in name

    # the model holds the means between steps: evaluation is repeatable and sees the means
    first = trainer.evaluate(_examples())["eval_loss"]
    assert trainer.evaluate(_examples())["eval_loss"] == first
    post = ivon_posterior(opt, model)
    assert torch.equal(post.mean["classifier.weight"], model.classifier.weight.detach())


def test_bf16_autocast_trains(tmp_path):
    model = _bert()
    opt = IVON(model.parameters(), generator=torch.Generator().manual_seed(0), **HYPER)
    before = model.classifier.weight.detach().clone()
    _trainer(tmp_path, model, opt, bf16=True).train()
    assert opt.current_step == 8
    assert model.classifier.weight.dtype == torch.float32
    assert torch.isfinite(model.classifier.weight).all()
    assert not torch.equal(model.classifier.weight.detach(), before)


def test_grad_scaler_flow_of_the_trainer(tmp_path):
    """fp16 as the Trainer runs it on a GPU: scale, backward, unscale_ + clip inside the sample, scaler.step.

    The Trainer's own fp16 mode needs a GPU; this replays its calls around the callback's events on the CPU
    and compares with the unscaled run.
    """
    runs = []
    for scale in (None, 2.0**10):
        model = _bert()
        opt = IVON(model.parameters(), generator=torch.Generator().manual_seed(0), **HYPER)
        scaler = torch.amp.GradScaler("cpu", init_scale=scale or 1.0, enabled=scale is not None)
        callback = IVONCallback()
        args, state, control = _args(tmp_path), None, None
        callback.on_train_begin(args, state, control, optimizer=opt)
        for batch in torch.utils.data.DataLoader(
            _examples(), batch_size=8, collate_fn=transformers.default_data_collator
        ):
            callback.on_step_begin(args, state, control)
            scaler.scale(model(**batch).loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            callback.on_pre_optimizer_step(args, state, control)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        callback.on_train_end(args, state, control)
        runs.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*runs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_training_stopped_inside_a_step_leaves_the_means(tmp_path):
    model = _bert()
    opt = IVON(model.parameters(), **HYPER)
    callback, args = IVONCallback(), _args(tmp_path)
    means = [p.detach().clone() for p in model.parameters()]
    callback.on_train_begin(args, None, None, optimizer=opt)
    callback.on_step_begin(args, None, None)
    assert not torch.equal(model.classifier.weight.detach(), means[-2])
    callback.on_train_end(args, None, None)
    for p, m in zip(model.parameters(), means, strict=True):
        torch.testing.assert_close(p.detach(), m, rtol=1e-6, atol=1e-7)
    with pytest.raises(RuntimeError, match="at least one gradient sample"):
        opt.step()  # the open sample was discarded, not collected


def test_callback_without_ivon_names_the_fix(tmp_path):
    model = _bert()
    adamw = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with pytest.raises(
        TypeError, match=r"got AdamW: pass Trainer\(\.\.\., optimizers=\(partialbayes\.ivon\.IVON\("
    ):
        _trainer(tmp_path, model, adamw).train()


def test_ivon_without_the_callback_names_the_fix(tmp_path):
    model = _bert()
    opt = IVON(model.parameters(), **HYPER)
    with pytest.raises(
        RuntimeError,
        match=r"outside sampled_params.*callbacks=\[partialbayes\.ivon\.IVONCallback\(\)\]",
    ):
        _trainer(tmp_path, model, opt, callbacks=()).train()


def test_several_processes_are_refused():
    class Args:
        world_size = 2

    model = _bert()
    with pytest.raises(ValueError, match="2 processes"):
        IVONCallback().on_train_begin(
            Args(), None, None, optimizer=IVON(model.parameters(), **HYPER)
        )
