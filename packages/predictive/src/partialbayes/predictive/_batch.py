"""Model plumbing: read a batch (tensor, ``(inputs, labels)`` pair, or mapping), call a model, free memory."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from partialbayes.predictive._validate import check_type

#: Label value that marks a position to ignore (Hugging Face and ``torch.nn.functional.cross_entropy``).
IGNORE_INDEX = -100
#: Keys under which a mapping batch may carry its labels, in the order they are looked up.
LABEL_KEYS = ("labels", "label")

_ACCEPTED = (
    "a tensor x, a pair (inputs, labels), or a mapping of model inputs (dict, transformers "
    "BatchEncoding) with optional 'labels' / 'label'"
)


@dataclass(frozen=True)
class Batch:
    """A batch split into ``inputs`` (tensor or keyword dict), ``labels`` and ``attention_mask`` ``[B, T]`` (or ``None``)."""

    inputs: Tensor | dict[str, Any]
    labels: Tensor | None
    attention_mask: Tensor | None

    @property
    def size(self) -> int:
        """Number of examples ``B`` (leading dimension of the inputs)."""
        return batch_size(self.inputs)


def split_batch(batch: Any, *, device: torch.device | str | None = None) -> Batch:
    """Split a tensor, ``(inputs, labels)`` pair or mapping batch (labels under ``"labels"`` / ``"label"``).

    Non-tensor labels go through ``torch.as_tensor``; tensors move to ``device`` when given.
    """
    paired = isinstance(batch, (tuple, list)) and len(batch) == 2
    inputs, labels = batch if paired else (batch, None)
    if isinstance(inputs, Mapping):
        found = [k for k in LABEL_KEYS if k in inputs]
        if len(found) + paired > 1:  # labels given twice (a pair's second element counts)
            where = f"both {found}" if len(found) > 1 else f"{found[0]!r} and as the pair's labels"
            raise ValueError(f"batch carries labels under {where}: give them once")
        labels = inputs[found[0]] if found else labels
        inputs = {str(k): v for k, v in inputs.items() if k not in LABEL_KEYS}
        lists = [k for k, v in inputs.items() if isinstance(v, list)]
        if lists:
            raise TypeError(
                f"batch input {lists[0]!r} is a list, not a tensor: the examples were not collated. Batch "
                "them with a collator (DataLoader(ds, batch_size=..., collate_fn=transformers."
                "DataCollatorWithPadding(tokenizer))) or tokenize with return_tensors='pt'"
            )
        if not inputs:
            raise ValueError(f"mapping batch holds no model inputs, only {sorted(found)}")
    elif paired and not isinstance(inputs, Tensor):
        raise TypeError(
            f"the inputs of a pair batch must be a tensor or a mapping, got {type(inputs).__name__}"
        )
    elif not isinstance(inputs, Tensor):
        shape = f" of length {len(batch)}" if isinstance(batch, (tuple, list)) else ""
        hint = (
            f" {batch!r}: iterating one batch (a dict or BatchEncoding) yields its keys. Pass a list "
            "of batches ([batch]) or a DataLoader"
            if isinstance(batch, str)
            else ""
        )
        raise TypeError(f"batch must be {_ACCEPTED}; got {type(batch).__name__}{shape}{hint}")
    if labels is not None and not isinstance(labels, Tensor):
        try:
            labels = torch.as_tensor(labels)
        except (TypeError, ValueError, RuntimeError) as err:
            raise TypeError(
                f"labels must be a tensor (or convertible to one), got {type(labels).__name__}"
            ) from err
    tensors = inputs.values() if isinstance(inputs, dict) else [inputs]
    if {int(t.shape[0]) for t in tensors if isinstance(t, Tensor) and t.ndim} == {0}:  # no example
        raise ValueError(
            "empty batch: the inputs hold 0 examples (drop empty batches before handing them over)"
        )
    if device is not None:
        labels = None if labels is None else labels.to(device)
        if isinstance(inputs, dict):
            inputs = {k: v.to(device) if isinstance(v, Tensor) else v for k, v in inputs.items()}
        else:
            inputs = inputs.to(device)
    mask = inputs.get("attention_mask") if isinstance(inputs, dict) else None
    check_type("attention_mask", mask, (Tensor, type(None)), "a tensor")
    return Batch(inputs=inputs, labels=labels, attention_mask=mask)


def _to(value: Any, device: torch.device) -> Any:
    return value.to(device) if isinstance(value, Tensor) else value


def move_batch(batch: Any, device: torch.device | str) -> Any:
    """A batch `split_batch` accepted, its tensors on ``device``, same kind (a mapping becomes a ``dict``, a pair a tuple)."""
    dev = torch.device(device)
    if isinstance(batch, Tensor):
        return batch.to(dev)
    if isinstance(batch, Mapping):
        return {k: _to(v, dev) for k, v in batch.items()}
    first, labels = batch  # a pair (split_batch checked the batch)
    if isinstance(first, Mapping):
        first = {k: _to(v, dev) for k, v in first.items()}
    return (_to(first, dev), _to(labels, dev))


def batch_size(inputs: Tensor | Mapping[str, Any]) -> int:
    """Number of examples in model inputs: the common leading size of its tensors."""
    check_type("inputs", inputs, (Tensor, Mapping), "a tensor or a mapping of tensors")
    if isinstance(inputs, Tensor):
        if inputs.ndim == 0:
            raise ValueError("inputs must have a batch dimension, got a 0-d tensor")
        return int(inputs.shape[0])
    sizes = {k: int(v.shape[0]) for k, v in inputs.items() if isinstance(v, Tensor) and v.ndim > 0}
    if len(set(sizes.values())) != 1:
        raise ValueError(f"cannot tell the batch size of inputs with leading sizes {sizes}")
    return next(iter(sizes.values()))


def take_inputs(inputs: Any, index: slice | Tensor, n: int) -> Any:
    """Examples ``index`` of model inputs of ``n`` examples (mapping values not ``[n, ...]`` tensors pass through)."""

    def take(v: Tensor) -> Tensor:
        return v[index.to(v.device) if isinstance(index, Tensor) else index]

    if isinstance(inputs, Tensor):
        return take(inputs)
    return {
        k: take(v) if isinstance(v, Tensor) and v.ndim and v.shape[0] == n else v
        for k, v in inputs.items()
    }


def output_logits(output: Any) -> Tensor:
    """The logits in a model's output: ``.logits``, else the first element of a tuple, else the tensor."""
    logits = getattr(output, "logits", output)
    if isinstance(logits, (tuple, list)) and logits:
        logits = logits[0]
    hint = "a logits tensor (or hold one: .logits, or a tuple's first element)"
    return check_type("the model output", logits, Tensor, hint)


def model_logits(model: nn.Module, inputs: Tensor | Mapping[str, Any]) -> Tensor:
    """``model(**inputs)`` for a mapping, ``model(inputs)`` else; its logits (inputs of a split `Batch`)."""
    out = model(**inputs) if isinstance(inputs, Mapping) else model(inputs)
    return output_logits(out)


@contextmanager
def eval_mode(model: nn.Module) -> Iterator[nn.Module]:
    """Put every module of ``model`` in eval mode (dropout off); restore each module's mode on exit."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield model
    finally:
        for m, mode in modes:
            m.training = mode


def available_memory(device: torch.device | str) -> tuple[int | None, str]:
    """Bytes free on ``device`` (``None``: unknown) and their source: CUDA free + cached, CPU ``MemAvailable``."""
    dev = torch.device(device)
    if dev.type == "cuda":
        free, _ = torch.cuda.mem_get_info(dev)
        cached = torch.cuda.memory_reserved(dev) - torch.cuda.memory_allocated(dev)
        return free + cached, "free + cached CUDA memory"
    if dev.type != "cpu":
        return None, f"unknown on {dev.type}"
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024, "MemAvailable in /proc/meminfo"
    except OSError:
        pass
    return None, "unknown (no /proc/meminfo)"


def kept_positions(
    logits: Tensor,
    *,
    attention_mask: Tensor | None = None,
    labels: Tensor | None = None,
    ignore_index: int = IGNORE_INDEX,
    shift: bool = False,
) -> Tensor | None:
    """``[B, T]`` bool mask of the positions of ``[B, T, C]`` logits that count as outputs (``None`` for ``[B, C]``).

    Positions with ``attention_mask`` 0 or labelled ``ignore_index`` are dropped. ``shift`` is the causal-LM
    convention (Hugging Face shifts the labels inside the model): the output at ``t`` is scored against
    ``labels[t + 1]`` and kept when tokens ``t`` and ``t + 1`` are real and ``labels[t + 1]`` is not ignored.

    Raises:
        ValueError: For ``[B, T, C]`` logits with neither an attention mask nor labels, or a mask / labels
            whose shape is not ``[B, T]``.
    """
    if logits.ndim != 3:
        return None
    b, t = logits.shape[:2]
    if attention_mask is None and labels is None:
        raise ValueError(
            f"token-level logits of shape {tuple(logits.shape)} need an attention_mask or labels "
            "(with -100 at ignored positions) to tell which positions count"
        )
    keep = torch.ones(b, t, dtype=torch.bool, device=logits.device)
    for name, given in (("attention_mask", attention_mask), ("labels", labels)):
        if given is not None and tuple(given.shape) != (b, t):
            raise ValueError(
                f"{name} of token-level logits must have shape [B, T] = {(b, t)}, "
                f"got {tuple(given.shape)}"
            )
    if attention_mask is not None:
        keep &= attention_mask.to(logits.device) != 0
    if labels is not None:
        kept = labels.to(logits.device) != ignore_index
        if shift:  # position t holds what t + 1 holds; the last has no target
            keep = keep & torch.cat([keep[:, 1:], keep[:, :1] & False], dim=1)
            kept = torch.cat([kept[:, 1:], kept[:, :1] & False], dim=1)
        keep &= kept
    return keep


#: Class-name endings of Hugging Face causal language models (``LlamaForCausalLM``, ``GPT2LMHeadModel``).
CAUSAL_LM_SUFFIXES = ("ForCausalLM", "LMHeadModel")


def is_causal_lm(model: nn.Module) -> bool:
    """Whether ``model`` (a base class, or a PEFT wrapper's ``get_base_model()``) is named a causal LM.

    Hugging Face's causal LMs (``...ForCausalLM``, ``...LMHeadModel``) shift their labels inside ``forward``.
    """
    get_base = getattr(model, "get_base_model", None)
    models = [model, get_base()] if callable(get_base) else [model]
    return any(c.__name__.endswith(CAUSAL_LM_SUFFIXES) for m in models for c in type(m).__mro__)


def flatten_outputs(
    logits: Tensor,
    labels: Tensor | None = None,
    *,
    attention_mask: Tensor | None = None,
    ignore_index: int = IGNORE_INDEX,
) -> tuple[Tensor, Tensor | None]:
    """Outputs as rows: ``[B, C]`` logits unchanged, ``[B, T, C]`` reduced to the kept positions ``[N, C]``.

    Token-level: every kept position (`kept_positions`) is one output, in row-major ``(b, t)`` order, and
    ``labels`` ``[B, T]`` go along. Returns ``(logits [N, C], labels [N] | None)``.
    """
    keep = kept_positions(
        logits, attention_mask=attention_mask, labels=labels, ignore_index=ignore_index
    )
    if keep is None:
        return logits, labels
    flat = logits[keep]
    return flat, (labels.to(logits.device)[keep] if labels is not None else None)
