"""Answer-only predictions on tiny causal LMs: answer positions, answer logits, sampled predictives."""

import gc
import weakref
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from partialbayes.predictive import (
    answer_logits,
    answer_positions,
    is_causal_lm,
    sampled_logits,
    sampled_predict,
)
from partialbayes.predictive.internal import check_target_ids

pytest.importorskip("transformers")
from tiny_models import tiny_model

FIXTURE_OK = settings(suppress_health_check=[HealthCheck.function_scoped_fixture], max_examples=10)
VOCAB = 40


def _lm(arch, device):
    return tiny_model(arch, "causal-lm", seed=0, vocab=VOCAB).to(device).eval()


def _prompts(lengths, answer_len, left, seed, device):
    """Prompts of the given lengths followed by ``answer_len`` answer tokens, padded to one length.

    Returns the batch (labels -100 except the answer) and, per example, the answer token positions.
    """
    g = torch.Generator().manual_seed(seed)
    t = max(lengths) + answer_len
    ids = torch.zeros(len(lengths), t, dtype=torch.long)
    mask = torch.zeros_like(ids)
    labels = torch.full_like(ids, -100)
    answers = []
    for i, n in enumerate(lengths):
        start = t - n - answer_len if left else 0
        real = slice(start, start + n + answer_len)
        ids[i, real] = torch.randint(1, VOCAB, (n + answer_len,), generator=g)
        mask[i, real] = 1
        pos = list(range(start + n, start + n + answer_len))
        labels[i, pos] = ids[i, pos]
        answers.append(pos)
    batch = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    return {k: v.to(device) for k, v in batch.items()}, answers


@FIXTURE_OK
@given(
    arch=st.sampled_from(["gpt2", "llama"]),
    lengths=st.lists(st.integers(1, 5), min_size=1, max_size=3),
    answer_len=st.integers(1, 2),
    left=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_answer_logits_are_the_shifted_label_positions(
    device, arch, lengths, answer_len, left, seed
):
    """With labels: the output before each answer token (causal LM), in row-major order, target columns."""
    model = _lm(arch, device)
    batch, answers = _prompts(lengths, answer_len, left, seed, device)
    ids = [7, 3, 31]
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    expected = torch.stack([logits[b, p - 1, ids] for b, pos in enumerate(answers) for p in pos])
    got = answer_logits(
        logits, ids, labels=batch["labels"], attention_mask=batch["attention_mask"], causal_lm=True
    )
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    # the prompts alone (no labels): the last real position of each predicts the first answer token
    prompt_mask = batch["attention_mask"].clone()
    for b, pos in enumerate(answers):
        prompt_mask[b, pos] = 0
    if left:  # left padding ends every sequence at T - 1: drop the answers by cutting the columns
        prompt_mask = batch["attention_mask"][:, :-answer_len]
        logits = logits[:, :-answer_len]  # causal: the prompt's outputs do not see the answers
    got = answer_logits(logits, ids, attention_mask=prompt_mask)
    expected = torch.stack([logits[b, pos[0] - 1, ids] for b, pos in enumerate(answers)])
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_answer_positions_without_shift_and_for_sequence_logits():
    labels = torch.tensor([[-100, 4, -100], [2, -100, 5]])
    keep = answer_positions(torch.zeros(2, 3, 9), labels=labels)
    assert keep.tolist() == [[False, True, False], [True, False, True]]
    shifted = answer_positions(torch.zeros(2, 3, 9), labels=labels, causal_lm=True)
    assert shifted.tolist() == [[True, False, False], [False, True, False]]
    assert answer_positions(torch.zeros(2, 9)) is None
    logits = torch.arange(18.0).reshape(2, 9)
    torch.testing.assert_close(answer_logits(logits, [8, 0]), logits[:, [8, 0]])
    no_mask = answer_positions(torch.zeros(2, 3, 9))
    assert no_mask.tolist() == [[False, False, True]] * 2
    with pytest.raises(ValueError, match="a sequence has no real token"):
        answer_positions(torch.zeros(2, 3, 9), attention_mask=torch.tensor([[1, 1, 0], [0, 0, 0]]))


@pytest.mark.parametrize(
    ("ids", "error", "match"),
    [
        ([], ValueError, "non-empty"),
        ([[1, 2]], ValueError, "1-D"),
        ([1, 9, 1], ValueError, "1 is repeated"),
        ([3, 10], ValueError, "10 is out of range for a model with 10 outputs"),
        ([-1], ValueError, "-1 is out of range"),
        ([1.0, 2.0], TypeError, "integer token ids"),
        ([True], TypeError, "integer token ids"),
        ("ab", TypeError, "integer token ids"),
    ],
)
def test_bad_target_ids_are_named(ids, error, match):
    with pytest.raises(error, match=match):
        check_target_ids(ids, 10)


class _NoisyHead:
    """Gaussian noise on the final layer norm's bias of a tiny LM; records every forward's logits."""

    def __init__(self, arch, device):
        self.model = _lm(arch, device)
        self.param = dict(self.model.named_parameters())[
            "transformer.ln_f.bias" if arch == "gpt2" else "model.norm.weight"
        ]
        self.map = self.param.detach().clone()
        self.outputs = []
        self.model.register_forward_hook(
            lambda m, a, out: self.outputs.append(weakref.ref(out.logits))
        )

    @contextmanager
    def ctx(self, draws, s):
        gc.collect()
        assert all(r() is None for r in self.outputs), (
            "an earlier sample's [B, T, V] logits are alive"
        )
        with torch.no_grad():
            self.param.copy_(self.map + draws[s])
        try:
            yield
        finally:
            with torch.no_grad():
                self.param.copy_(self.map)


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_sampled_answer_logits_and_predict_select_per_sample(device, arch):
    """Each sample's [B, T, V] logits are reduced to [P, K] before the next; the predictive renormalises."""
    head = _NoisyHead(arch, device)
    post = SimpleNamespace(model=head.model)
    batch, _ = _prompts([3, 2, 4], 1, False, 0, device)
    g = torch.Generator().manual_seed(0)
    draws = 0.5 * torch.randn(6, *head.map.shape, generator=g, dtype=head.map.dtype).to(device)
    assert is_causal_lm(head.model)
    ids = [5, 1, 30, 12]
    got = sampled_logits(post, batch, 6, target_ids=ids, sample_ctx=lambda s: head.ctx(draws, s))
    probs = sampled_predict(post, batch, 6, target_ids=ids, sample_ctx=lambda s: head.ctx(draws, s))
    head.outputs.clear()
    full = sampled_logits(post, batch, 6, sample_ctx=lambda s: torch.no_grad())  # the MAP, 6 times
    assert got.shape == (6, 3, 4)
    for s in range(6):
        head.outputs.clear()  # this loop holds the whole logits on purpose
        with head.ctx(draws, s), torch.no_grad():
            logits = head.model(**{k: v for k, v in batch.items() if k != "labels"}).logits
        expected = answer_logits(logits, ids, labels=batch["labels"], causal_lm=True)
        torch.testing.assert_close(got[s], expected)
    torch.testing.assert_close(probs, got.softmax(-1).mean(0))
    torch.testing.assert_close(probs.sum(-1), torch.ones(3, dtype=probs.dtype, device=device))
    assert full.shape[-1] == VOCAB
    with pytest.raises(ValueError, match="not for regression"):
        sampled_predict(post, batch, 2, target_ids=ids, regression=True)
    with pytest.raises(ValueError, match="40 is out of range"):
        sampled_logits(post, batch, 2, target_ids=[40], sample_ctx=lambda s: torch.no_grad())
