"""Discovery of the linear maps of a model and their attention / MLP grouping."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping

from torch import Tensor, nn

Grouping = Mapping[str, str] | Callable[[str], "str | None"]
"""A user grouping: ``{group: regex}`` (first ``re.search`` match wins) or a function ``name -> group | None``."""

# Order matters: the classification head first (RoBERTa's ``classifier.out_proj``), attention before MLP
# (BERT's ``attention.output.dense`` vs ``output.dense``).
_DEFAULT_RULES: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("mlp", re.compile(r"(^|\.)(pre_classifier|classifier|score|pooler)(\.|$)")),
    ("attention", re.compile(r"(^|\.)(q_lin|k_lin|v_lin|out_lin)$")),
    ("attention", re.compile(r"(^|\.)attention\.self\.(query|key|value)$")),
    ("attention", re.compile(r"(^|\.)attention\.output\.dense$")),
    ("attention", re.compile(r"(^|\.)attn\.(c_attn|q_attn|c_proj)$")),
    (
        "attention",
        re.compile(r"(^|\.)(self_attn|attention|attn)\.(q_proj|k_proj|v_proj|o_proj|out_proj)$"),
    ),
    ("mlp", re.compile(r"(^|\.)ffn\.(lin1|lin2)$")),
    ("mlp", re.compile(r"(^|\.)intermediate\.dense$")),
    ("mlp", re.compile(r"(^|\.)output\.dense$")),
    ("mlp", re.compile(r"(^|\.)mlp\.(c_fc|c_proj|fc1|fc2|gate_proj|up_proj|down_proj)$")),
    ("mlp", re.compile(r"(^|\.)(fc1|fc2)$")),
)


def is_conv1d(module: nn.Module) -> bool:
    """Whether ``module`` is a Hugging Face ``Conv1D`` (GPT-2): a linear map stored as (n_in x n_out).

    Detected by duck typing, without importing transformers.
    """
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf") and hasattr(module, "weight")


def linear_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Return the linear maps of ``model`` by qualified name, in registration order.

    Args:
        model: Any ``torch.nn.Module``.

    Returns:
        Mapping from module name (as in ``model.named_modules()``) to every ``nn.Linear`` and Hugging Face
        ``Conv1D`` module.

    Raises:
        TypeError: If ``model`` is not an ``nn.Module``.
        ValueError: If ``model`` has no linear maps.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    found = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear) or is_conv1d(m)}
    if not found:
        raise ValueError(f"model {type(model).__name__} has no linear maps (nn.Linear or Conv1D)")
    return found


def linear_shape(module: nn.Module) -> tuple[int, int]:
    """Logical shape (n_out, n_in) of a linear map (``nn.Linear`` or ``Conv1D``)."""
    w = module.weight
    if not isinstance(w, Tensor):
        raise TypeError(f"module {type(module).__name__} has no weight tensor")
    if is_conv1d(module):
        return int(w.shape[1]), int(w.shape[0])
    return int(w.shape[0]), int(w.shape[1])


def module_group(name: str, grouping: Grouping | None = None) -> str | None:
    """Group of a linear map by its qualified name: ``"attention"``, ``"mlp"`` or ``None``.

    Default rules (DistilBERT, BERT / MiniLM, RoBERTa, GPT-2 naming, plus common ``q_proj``/``fc1`` naming):
    attention = Q, K, V and output projections (``q_lin``, ``k_lin``, ``v_lin``, ``out_lin``;
    ``attention.self.query|key|value``, ``attention.output.dense``; ``attn.c_attn``, ``attn.c_proj``);
    mlp = feed-forward in / out (``ffn.lin1|lin2``; ``intermediate.dense``, ``output.dense``;
    ``mlp.c_fc|c_proj``) and the classification head (``pre_classifier``, ``classifier``, ``score``,
    ``pooler``), as in Kampen et al.

    Args:
        name: Module name, or a parameter name ending in ``.weight`` / ``.bias``.
        grouping: Optional user grouping: a mapping ``{group: regex}`` (the first group whose pattern
            ``re.search``-matches the name wins) or a function ``name -> group | None``.

    Returns:
        The group name, or ``None`` when no rule matches.

    Raises:
        TypeError: If ``name`` is not a string, or ``grouping`` is of the wrong type or returns a non-string.
    """
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, got {type(name).__name__}")
    for suffix in (".weight", ".bias"):
        if name.endswith(suffix):
            name = name[: -len(suffix)]
            break
    if grouping is None:
        for rule_group, rule in _DEFAULT_RULES:
            if rule.search(name):
                return rule_group
        return None
    if isinstance(grouping, Mapping):
        for group, pattern in grouping.items():
            if not isinstance(group, str) or not isinstance(pattern, (str, re.Pattern)):
                raise TypeError(
                    f"grouping must map group names to regex strings, got {group!r}: {pattern!r}"
                )
            if re.search(pattern, name):
                return group
        return None
    if callable(grouping):
        found = grouping(name)
        if found is not None and not isinstance(found, str):
            raise TypeError(
                f"grouping function returned {found!r} for module {name!r}; expected a str or None"
            )
        return found
    raise TypeError(
        f"grouping must be a mapping {{group: regex}} or a callable, got {type(grouping).__name__}"
    )


def grouped_linear_modules(
    model: nn.Module, group: str = "all", grouping: Grouping | None = None
) -> dict[str, nn.Module]:
    """Linear maps of ``model`` in ``group`` (``"all"`` for every linear map), in model order.

    Raises:
        ValueError: If no linear map belongs to ``group``, listing the groups that exist.
    """
    mods = linear_modules(model)
    if group == "all":
        return mods
    picked = {n: m for n, m in mods.items() if module_group(n, grouping) == group}
    if not picked:
        groups = sorted({str(module_group(n, grouping)) for n in mods})
        raise ValueError(
            f"group={group!r} matches no linear map of {type(model).__name__}; groups present: "
            f"{groups} (or 'all')"
        )
    return picked
