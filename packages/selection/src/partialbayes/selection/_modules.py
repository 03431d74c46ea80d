"""Discovery of the linear maps of a model and their attention / MLP / other grouping."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from torch import Tensor, nn

from partialbayes.selection._validate import check_names, check_type

Grouping = Mapping[str, str] | Callable[[str], "str | None"]
"""A user grouping: ``{group: regex}`` (first ``re.search`` match wins) or a function ``name -> group | None``."""

ATTENTION = "attention"
"""Group of the self- and cross-attention maps (queries, keys, values, output projection)."""
MLP = "mlp"
"""Group of the feed-forward maps, poolers and output heads (classification or language-model head)."""
OTHER = "other"
"""Group of a linear map that no rule places (e.g. ELECTRA's ``embeddings_project``)."""

# Name segments (compared in lower case) and class patterns of the default rules (see `module_groups`).
_ATTENTION_SEGMENTS = frozenset(
    {
        "attention", "attn", "self_attn", "self_attention", "selfattention", "crossattention",
        "cross_attention", "cross_attn", "encoder_attn", "encdecattention",
        "query", "key", "value", "q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj",
        "q_lin", "k_lin", "v_lin", "out_lin", "c_attn", "q_attn", "wqkv",
    }
)  # fmt: skip
_MLP_SEGMENTS = frozenset(
    {
        "mlp", "ffn", "feed_forward", "feedforward", "intermediate", "output", "densereludense",
        "fc1", "fc2", "c_fc", "lin1", "lin2", "gate_proj", "up_proj", "down_proj", "experts",
        "pooler", "classifier", "pre_classifier", "score", "lm_head", "head", "classification_head",
        "cls", "qa_outputs",
    }
)  # fmt: skip
_ATTENTION_CLASS = re.compile(r"Attention|Attn")
_MLP_CLASS = re.compile(
    r"MLP|Mlp|FFN|Ffn|FeedForward|Intermediate|Output|Dense(Relu|Act|GatedAct)Dense|LayerFF|Pooler|"
    r"Head|Classifier|Predictions|MoE|Moe|Expert"
)

# PEFT: ``q.base_layer``, ``q.lora_A.<adapter>``, ``h.modules_to_save.<adapter>``, ``h.original_module``.
_PEFT_LEAVES = frozenset({"base_layer", "original_module"})
_PEFT_DICTS = frozenset({"lora_A", "lora_B", "modules_to_save"})


def is_conv1d(module: nn.Module) -> bool:
    """Whether ``module`` is a Hugging Face ``Conv1D`` (linear map stored n_in x n_out), by duck typing."""
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf") and hasattr(module, "weight")


def linear_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Every ``nn.Linear`` and Hugging Face ``Conv1D`` of ``model`` by qualified name, in registration order.

    Raises:
        TypeError: If ``model`` is not an ``nn.Module``.
        ValueError: If ``model`` has no linear maps.
    """
    check_type("model", model, nn.Module, "a torch.nn.Module")
    found = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear) or is_conv1d(m)}
    if not found:
        raise ValueError(f"model {type(model).__name__} has no linear maps (nn.Linear or Conv1D)")
    return found


def tied_linear_modules(model: nn.Module) -> dict[str, str]:
    """``{linear map: parameter it shares its weight with}`` for maps whose weight another module registers first.

    A language-model head tied to the token embedding (GPT-2, T5) is one; such maps are never candidates of
    the selection strategies.
    """
    owner = {id(p): n for n, p in model.named_parameters()}
    out: dict[str, str] = {}
    for name, mod in linear_modules(model).items():
        w = mod.weight
        own = f"{name}.weight" if name else "weight"
        if isinstance(w, Tensor) and owner.get(id(w), own) != own:
            out[name] = owner[id(w)]
    return out


def linear_shape(module: nn.Module) -> tuple[int, int]:
    """Logical shape (n_out, n_in) of a linear map (``nn.Linear`` or ``Conv1D``)."""
    n_out, n_in = module.weight.shape
    return (int(n_in), int(n_out)) if is_conv1d(module) else (int(n_out), int(n_in))


def _module_name(name: str) -> str:
    """``"a.b.weight" -> "a.b"``; module names pass unchanged."""
    for suffix in (".weight", ".bias"):
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def _peft_kept(parts: list[str]) -> list[int]:
    """Indices of the path segments that are not PEFT's own (``base_layer``, ``lora_A.default``, ``modules_to_save``...)."""
    kept: list[int] = []
    skip_next = False
    for i, seg in enumerate(parts):
        if skip_next:  # the adapter name below lora_A / lora_B / modules_to_save
            skip_next = False
        elif seg in _PEFT_DICTS and 0 < i < len(parts) - 1:
            skip_next = True
        elif not (seg in _PEFT_LEAVES and i > 0):
            kept.append(i)
    return kept


@dataclass(frozen=True)
class _Node:
    """One module on the path from the model to a linear map: attribute name and class name (or None)."""

    segment: str
    cls: str | None


def _is_container(module: nn.Module) -> bool:
    """Whole models and PEFT wrappers, whose class names say nothing about the maps inside."""
    return "Model" in type(module).__name__ or hasattr(module, "base_model_prefix")


def _default_group(path: Iterable[_Node]) -> str:
    """The default rules on a path of modules (the map itself last); ``OTHER`` when none matches."""
    nodes = list(path)
    segments = [n.segment.lower() for n in nodes]
    classes = [n.cls for n in nodes[:-1] if n.cls is not None]
    if any(s in _ATTENTION_SEGMENTS for s in segments) or any(
        _ATTENTION_CLASS.search(c) for c in classes
    ):
        return ATTENTION
    if any(s in _MLP_SEGMENTS for s in segments) or any(_MLP_CLASS.search(c) for c in classes):
        return MLP
    return OTHER


def _name_path(name: str) -> list[_Node]:
    """Nodes of a bare name (no classes known)."""
    parts = name.split(".")
    return [_Node(parts[i], None) for i in _peft_kept(parts) if parts[i]]


def _model_path(name: str, modules: Mapping[str, nn.Module]) -> list[_Node]:
    """Nodes from the model down to ``name`` (PEFT segments dropped, whole-model containers unnamed)."""
    parts = name.split(".")
    nodes = []
    for i in _peft_kept(parts):
        mod = modules[".".join(parts[: i + 1])]
        nodes.append(_Node(parts[i], None if _is_container(mod) else type(mod).__name__))
    return nodes


def _user_group(name: str, grouping: Grouping) -> str | None:
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
        what = f"grouping({name!r}) (the group of module {name!r})"
        return check_type(what, grouping(name), (str, type(None)), "a str or None")
    raise TypeError(
        f"grouping must be a mapping {{group: regex}} or a callable, got {type(grouping).__name__}"
    )


def module_groups(model: nn.Module, grouping: Grouping | None = None) -> dict[str, str]:
    """Group of every linear map of ``model``: each map is in exactly one group.

    Default rules (``grouping=None``, stated on the selection concept page): ``"attention"`` when a name or
    class on the map's path is an attention one (``attn``, ``query``, ``q_proj``, ``BertSelfAttention``...),
    else ``"mlp"`` for feed-forward maps, poolers and heads (``mlp``, ``intermediate``, ``output``,
    ``classifier``, ``lm_head``...), else ``"other"``. PEFT wrappers take the group of the module they wrap.

    Args:
        model: The model.
        grouping: Optional user grouping instead of the default rules: a mapping ``{group: regex}`` (the
            first group whose pattern ``re.search``-matches the module name wins) or a function
            ``name -> group | None``. A map it leaves out (``None``) is in ``"other"``.

    Returns:
        ``{linear map name: group}`` in model order.

    Raises:
        TypeError: If ``grouping`` is of the wrong type or returns a non-string.
        ValueError: If ``model`` has no linear maps.
    """
    lin = linear_modules(model)
    if grouping is not None:
        return {n: _user_group(n, grouping) or OTHER for n in lin}
    modules = dict(model.named_modules())
    return {n: _default_group(_model_path(n, modules)) if n else OTHER for n in lin}


def module_group(
    name: str, grouping: Grouping | None = None, *, model: nn.Module | None = None
) -> str | None:
    """Group of one linear map: ``"attention"``, ``"mlp"``, ``"other"``, or ``None`` without ``model``.

    With ``model`` the rules of :func:`module_groups` apply. Without it only the names on the path count, and a
    name no rule matches gives ``None`` (a name alone cannot tell a linear map from any other module).

    Args:
        name: Module name, or a parameter name ending in ``.weight`` / ``.bias``.
        grouping: Optional user grouping (see :func:`module_groups`).
        model: The model the name belongs to (enables the class rules and the ``"other"`` group).

    Raises:
        TypeError: If ``name`` is not a string, or ``grouping`` is of the wrong type or returns a non-string.
        ValueError: If ``model`` is given and ``name`` is not one of its linear maps.
    """
    check_type("name", name, str, "a str")
    name = _module_name(name)
    if model is not None:
        groups = module_groups(model, grouping)
        if name not in groups:
            raise ValueError(
                f"{name!r} is not a linear map of {type(model).__name__} (nn.Linear or Conv1D)"
            )
        return groups[name]
    if grouping is not None:
        return _user_group(name, grouping)
    group = _default_group(_name_path(name))
    return None if group == OTHER else group


def _peft_originals(model: nn.Module) -> list[str]:
    """Names of PEFT's frozen ``original_module`` copies beside a ``modules_to_save`` copy."""
    return [
        f"{name}.original_module" if name else "original_module"
        for name, mod in model.named_modules()
        if isinstance(getattr(mod, "modules_to_save", None), nn.ModuleDict)
        and isinstance(getattr(mod, "original_module", None), nn.Module)
    ]


def candidate_modules(
    model: nn.Module, modules: Iterable[str] | None = None
) -> dict[str, nn.Module]:
    """``{name: module}`` a strategy may select, in model order: the named ``modules``, or every linear map.

    The default leaves out maps whose weight is tied to another module and PEFT's ``original_module`` copies.
    Unknown names (close matches), an empty ``modules`` or a tied named map raise ``ValueError``.
    """
    mods = linear_modules(model)
    tied = tied_linear_modules(model)
    if modules is None:
        idle = _peft_originals(model)
        return {
            n: m
            for n, m in mods.items()
            if n not in tied and not any(n == p or n.startswith(f"{p}.") for p in idle)
        }
    names = set(check_names(modules, mods, "linear module"))
    if not names:
        raise ValueError("modules is empty; pass None for every linear map")
    for n in mods:
        if n in names and n in tied:
            raise ValueError(
                f"linear module {n!r} shares its weight with {tied[n]!r} (tied weights, e.g. a head tied to "
                "the token embedding) and cannot be made stochastic"
            )
    return {n: m for n, m in mods.items() if n in names}


def grouped_linear_modules(
    model: nn.Module,
    group: str = "all",
    grouping: Grouping | None = None,
    modules: Iterable[str] | None = None,
) -> dict[str, nn.Module]:
    """The `candidate_modules` of ``model`` in ``group`` (``"all"``: every one, else a group of `module_group`).

    Raises ``ValueError`` listing the existing groups if no candidate belongs to ``group``.
    """
    mods = candidate_modules(model, modules)
    if group == "all":
        return mods
    groups = module_groups(model, grouping)
    picked = {n: m for n, m in mods.items() if groups[n] == group}
    if not picked:
        present = sorted({groups[n] for n in mods})
        among = " among the given modules" if modules is not None else ""
        raise ValueError(
            f"group={group!r} matches no linear map of {type(model).__name__}{among}; groups present: "
            f"{present} (or 'all')"
        )
    return picked
