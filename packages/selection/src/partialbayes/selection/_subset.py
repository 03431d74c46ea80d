"""The Subset type: parameter name -> block (Kronecker-structured or elementwise mask)."""

from __future__ import annotations

import difflib
import json
import re
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from partialbayes.selection._blocks import Block, KronBlock, KronModule, MaskBlock
from partialbayes.selection._modules import is_conv1d, linear_shape
from partialbayes.selection._validate import check_type

_FORMAT = "partialbayes.selection.Subset"
_VERSION = 1

EMBEDDINGS = "embeddings"
"""Default ``exclude`` of :meth:`Subset.percent_of`: parameters of every ``nn.Embedding`` module."""


@dataclass(frozen=True)
class _ParamInfo:
    """Structure of one model parameter (internal)."""

    index: int
    shape: torch.Size
    transposed: bool
    module_name: str | None  # linear map owning it, if any
    role: str | None  # "weight" / "bias" of that linear map
    n_out: int
    n_in: int


def _model_structure(model: nn.Module) -> dict[str, _ParamInfo]:
    """Parameter name -> structure, in ``named_parameters`` order."""
    check_type("model", model, nn.Module, "a torch.nn.Module")
    owner: dict[str, tuple[bool, str, str, int, int]] = {}
    for mname, mod in model.named_modules():
        if isinstance(mod, nn.Linear) or is_conv1d(mod):
            prefix = f"{mname}." if mname else ""
            n_out, n_in = linear_shape(mod)
            owner[prefix + "weight"] = (is_conv1d(mod), mname, "weight", n_out, n_in)
            if getattr(mod, "bias", None) is not None:
                owner[prefix + "bias"] = (False, mname, "bias", n_out, n_in)
    none = (False, None, None, 0, 0)
    return {
        name: _ParamInfo(i, p.shape, *owner.get(name, none))
        for i, (name, p) in enumerate(model.named_parameters())
    }


def _close(name: str, options: Iterable[str]) -> str:
    """Text listing close matches of ``name`` among ``options``."""
    matches = difflib.get_close_matches(name, list(options), n=3, cutoff=0.5)
    return f"; close matches: {matches}" if matches else ""


def _check_block(name: str, block: Any, info: _ParamInfo) -> None:
    """Validate one block against its parameter; raise naming the parameter."""
    shape = info.shape
    if isinstance(block, MaskBlock):
        if block.mask.shape != shape:
            raise ValueError(
                f"MaskBlock for {name!r} has shape {tuple(block.mask.shape)}, the parameter has "
                f"storage shape {tuple(shape)}"
            )
        empty = "" if bool(block.mask.any()) else "selects no entries"
    else:
        check_type(f"block for {name!r}", block, KronBlock, "a KronBlock or MaskBlock")
        given = {w: getattr(block, w) for w in ("rows", "cols")}
        empty = next(
            (f"has empty {w}" for w, i in given.items() if i is not None and not i.numel()), ""
        )
    if empty:
        raise ValueError(f"{type(block).__name__} for {name!r} {empty}; leave the parameter out")
    if isinstance(block, MaskBlock):
        return
    if len(shape) == 1:
        if block.cols is not None:
            raise ValueError(f"KronBlock for 1-D {name!r} (e.g. a bias) must have cols=None")
        limits = {"rows": int(shape[0])}
    elif len(shape) == 2:
        if info.transposed:
            limits = {"rows": int(shape[1]), "cols": int(shape[0])}
        else:
            limits = {"rows": int(shape[0]), "cols": int(shape[1])}
    else:
        if block.rows is not None or block.cols is not None:
            raise ValueError(
                f"KronBlock with indices needs a 1-D or 2-D parameter; {name!r} has shape "
                f"{tuple(shape)}: use MaskBlock or KronBlock() (all entries)"
            )
        return
    for what, limit in limits.items():
        idx = getattr(block, what)
        if idx is not None and int(idx.max()) >= limit:
            raise ValueError(
                f"KronBlock {what} for {name!r} contains index {int(idx.max())}, out of range for "
                f"size {limit} (logical shape n_out x n_in)"
            )


class Subset:
    """The stochastic subset of a model's weights: parameter name -> block.

    Build it with :meth:`from_model` (validates against the model) or a selection strategy.
    Blocks are :class:`KronBlock` (Kronecker-structured ``rows x cols``, ``None`` = all) or
    :class:`MaskBlock` (boolean mask in storage shape). A Subset may be empty (e.g. ``ramp`` count 0).
    """

    __slots__ = ("_blocks", "_info")

    def __init__(self, blocks: Mapping[str, Block], info: Mapping[str, _ParamInfo]) -> None:
        """Internal: use :meth:`from_model`. ``info`` describes every parameter of the model."""
        self._info = dict(info)
        self._blocks = {n: blocks[n] for n in sorted(blocks, key=lambda n: self._info[n].index)}

    # --------------------------------------------------------------------------- construction
    @classmethod
    def from_model(cls, model: nn.Module, blocks: Mapping[str, Block]) -> Subset:
        """Build a Subset of ``model`` from ``{parameter name: KronBlock | MaskBlock}``, validated, in model order.

        Raises:
            ValueError: Unknown parameter name (with close matches), index out of range, mask of the
                wrong shape, block selecting nothing.
            TypeError: A block of the wrong type.
        """
        info = _model_structure(model)
        check_type("blocks", blocks, Mapping, "a mapping name -> block")
        for name, block in blocks.items():
            if name not in info:
                raise ValueError(
                    f"unknown parameter {name!r} for model {type(model).__name__}{_close(name, info)}"
                )
            _check_block(name, block, info[name])
        return cls(blocks, info)

    def _spawn(self, blocks: Mapping[str, Block]) -> Subset:
        return Subset(blocks, self._info)

    # --------------------------------------------------------------------------- inspection
    @property
    def names(self) -> tuple[str, ...]:
        """Parameter names in the subset, in model order."""
        return tuple(self._blocks)

    def _get(self, name: str) -> Block:
        check_type("parameter name", name, str, "a string")
        if name not in self._blocks:
            where = "model" if name not in self._info else "subset"
            raise KeyError(f"parameter {name!r} is not in the {where}{_close(name, self._blocks)}")
        return self._blocks[name]

    def block(self, name: str) -> Block:
        """The block of parameter ``name``."""
        return self._get(name)

    def shape(self, name: str) -> torch.Size:
        """Storage shape of parameter ``name``."""
        self._get(name)
        return self._info[name].shape

    def transposed(self, name: str) -> bool:
        """``True`` when ``name`` is a Hugging Face ``Conv1D`` weight (storage n_in x n_out)."""
        self._get(name)
        return self._info[name].transposed

    def __contains__(self, name: object) -> bool:
        return name in self._blocks

    def __len__(self) -> int:
        return len(self._blocks)

    def __iter__(self) -> Iterator[str]:
        return iter(self._blocks)

    @property
    def is_kronecker(self) -> bool:
        """Whether every block is a :class:`KronBlock`."""
        return all(isinstance(b, KronBlock) for b in self._blocks.values())

    def mask(self, name: str) -> Tensor:
        """Boolean mask of ``name`` in storage shape, on cpu."""
        b = self._get(name)
        shape = self._info[name].shape
        if isinstance(b, MaskBlock):
            return b.mask.clone()
        if len(shape) not in (1, 2):
            return torch.ones(shape, dtype=torch.bool)
        m = torch.zeros(shape, dtype=torch.bool)
        self._put(name, m, torch.ones(self.num_entries(name), dtype=torch.bool))
        return m

    def num_entries(self, name: str | None = None) -> int:
        """Number of stochastic entries of ``name``, or of the whole subset when ``name`` is None."""
        if name is None:
            return sum(self.num_entries(n) for n in self._blocks)
        b = self._get(name)
        shape = self._info[name].shape
        if isinstance(b, MaskBlock):
            return int(b.mask.sum())
        if len(shape) not in (1, 2):
            return int(shape.numel())
        r, c = (b.cols, b.rows) if self._info[name].transposed else (b.rows, b.cols)  # storage dims
        n = int(shape[0]) if r is None else int(r.numel())
        if len(shape) == 2:
            n *= int(shape[1]) if c is None else int(c.numel())
        return n

    def _check_storage(self, name: str, tensor: Tensor, what: str) -> None:
        check_type(f"{what} for {name!r}", tensor, Tensor, "a Tensor")
        if tensor.shape != self._info[name].shape:
            raise ValueError(
                f"{what} for {name!r} has shape {tuple(tensor.shape)}, expected storage shape "
                f"{tuple(self._info[name].shape)}"
            )

    def gather(self, name: str, tensor: Tensor) -> Tensor:
        """The stochastic entries of a storage-shaped ``tensor`` as a 1-D tensor.

        Order: row-major order of the storage mask (``tensor[mask]``).
        """
        b = self._blocks.get(name) if isinstance(name, str) else None
        if b is None or not isinstance(tensor, Tensor) or tensor.shape != self._info[name].shape:
            self._get(name)  # each raises naming the culprit
            self._check_storage(name, tensor, "tensor")
        if isinstance(b, KronBlock) and tensor.ndim in (1, 2):
            t = self._info[name].transposed  # storage dims: a Conv1D stores n_in x n_out
            r, c = (b.cols, b.rows) if t else (b.rows, b.cols)
            out = tensor if r is None else tensor.index_select(0, r.to(tensor.device))
            if tensor.ndim == 2 and c is not None:
                out = out.index_select(1, c.to(tensor.device))
            return out.reshape(-1)
        return tensor[self.mask(name).to(tensor.device)]

    def scatter(self, name: str, values: Tensor, into: Tensor) -> Tensor:
        """Return a copy of ``into`` with its stochastic entries replaced by the 1-D ``values``."""
        self._get(name)
        self._check_storage(name, into, "into")
        n = self.num_entries(name)
        if not isinstance(values, Tensor) or values.ndim != 1 or values.numel() != n:
            got = tuple(values.shape) if isinstance(values, Tensor) else type(values).__name__
            raise ValueError(f"values for {name!r} must be 1-D with {n} entries, got {got}")
        out = into.clone()
        out[self.mask(name).to(into.device)] = values.to(device=into.device, dtype=into.dtype)
        return out

    def _put(self, name: str, tensor: Tensor, values: Tensor) -> None:
        """Write the 1-D ``values`` into the stochastic entries of ``tensor``, in place (`gather` order)."""
        b = self._blocks[name]
        values = values.to(device=tensor.device, dtype=tensor.dtype)
        if not (isinstance(b, KronBlock) and tensor.ndim in (1, 2)):
            tensor[self.mask(name).to(tensor.device)] = values
            return
        rc = (b.cols, b.rows) if self._info[name].transposed else (b.rows, b.cols)  # storage dims
        r, c = (None if i is None else i.to(tensor.device) for i in rc)
        if tensor.ndim == 1 or c is None:
            shape = (tensor.shape[0] if r is None else r.numel(), *tensor.shape[1:])
            if r is None:
                tensor.copy_(values.view(shape))
            else:
                tensor[r] = values.view(shape)
        elif r is None:
            tensor[:, c] = values.view(tensor.shape[0], c.numel())
        else:
            tensor[r[:, None], c[None, :]] = values.view(r.numel(), c.numel())

    def check_values(self, values: Any, what: str = "sample") -> dict[str, Tensor]:
        """Validate one value per stochastic entry, ``{param name: [k]}`` (or ``[1, k]``); return ``{name: [k]}``.

        ``what`` names ``values`` in the messages (e.g. one row of a posterior's ``sample(n)``).

        Raises:
            TypeError: If ``values`` is not a mapping of tensors.
            ValueError: If it misses a parameter of the subset or names another one, a value has the
                wrong number of entries, or holds NaN or inf (the parameter is named).
        """
        check_type(
            what, values, Mapping, "a mapping {param name: [k] tensor} (one row of sample(n))"
        )
        missing = [n for n in self._blocks if n not in values]
        extra = [n for n in values if n not in self._blocks]
        if missing or extra:
            raise ValueError(
                f"{what} must cover the subset exactly: missing {missing[:5]}, unknown {extra[:5]}"
            )
        out: dict[str, Tensor] = {}
        for name in self._blocks:
            v, k = values[name], self.num_entries(name)
            check_type(f"{what}[{name!r}]", v, Tensor, "a tensor")
            if v.ndim == 2 and v.shape[0] == 1:
                v = v[0]
            if v.ndim != 1 or v.shape[0] != k:
                raise ValueError(
                    f"{what}[{name!r}] has shape {tuple(v.shape)}, expected [k] = [{k}] "
                    "(one row of sample(n))"
                )
            out[name] = v
        if out:
            finite = torch.stack([torch.isfinite(v).all() for v in out.values()]).tolist()
            bad = [n for n, ok in zip(out, finite, strict=True) if not ok]
            if bad:  # one synchronisation for the whole sample
                raise ValueError(
                    f"{what} has NaN or inf entries in {bad[:5]}: refusing to write them into the model"
                )
        return out

    def parameters_of(self, model: nn.Module) -> dict[str, nn.Parameter]:
        """The subset's parameters of ``model``, by name (checked: present, same shape, not on ``meta``).

        Raises:
            TypeError: If ``model`` is not an ``nn.Module``.
            ValueError: If a parameter of the subset is missing from ``model``, has another shape, or
                lives on the ``meta`` device (no values to read or write; load real weights first).
        """
        params = dict(check_type("model", model, nn.Module, "a torch.nn.Module").named_parameters())
        out: dict[str, nn.Parameter] = {}
        for name in self._blocks:
            p = params.get(name)
            if p is None or p.shape != self._info[name].shape:
                got = "missing" if p is None else f"shape {tuple(p.shape)}"
                raise ValueError(
                    f"model {type(model).__name__} does not fit the subset: parameter {name!r} is {got}, "
                    f"the subset was built for shape {tuple(self._info[name].shape)}"
                )
            if p.is_meta:
                raise ValueError(
                    f"parameter {name!r} of {type(model).__name__} is on the meta device (no values): "
                    "load the real weights (e.g. from_pretrained without device_map='meta' / "
                    "init_empty_weights) before building a posterior"
                )
            out[name] = p
        return out

    @contextmanager
    def swapped(self, model: nn.Module, values: Mapping[str, Tensor]) -> Iterator[nn.Module]:
        """Write ``values`` (``{param name: [k]}``, see `check_values`) into ``model``; restore what was there on exit.

        The one way every posterior family swaps a weight sample in: the subset's entries found on entry are
        written back on exit, even when the body raises, so nested swaps unwind and user changes stay. Yields
        ``model``; errors as `check_values` and `parameters_of`, with the model left untouched.
        """
        params = self.parameters_of(model)
        new = self.check_values(values)
        # no_grad only around the reads and writes: the body keeps autograd as the caller has it
        with torch.no_grad():
            saved = {n: self.gather(n, p.detach()).clone() for n, p in params.items()}
        try:
            with torch.no_grad():
                for name, v in new.items():
                    self._put(name, params[name].data, v)
            yield model
        finally:
            with torch.no_grad():
                for name, v in saved.items():
                    self._put(name, params[name].data, v)

    def kron_modules(self) -> dict[str, KronModule]:
        """Linear maps of a Kronecker-structured subset, by module name, in model order.

        Raises:
            TypeError: If a block is a :class:`MaskBlock` (KFAC needs Kronecker structure).
            ValueError: If a selected parameter is not the weight / bias of a linear map, a bias is
                selected without its weight, or the bias rows differ from the weight rows.
        """
        for n, b in self._blocks.items():
            if isinstance(b, MaskBlock):
                raise TypeError(
                    f"parameter {n!r} has an elementwise MaskBlock; Kronecker-factored methods need "
                    "KronBlock blocks (e.g. from sparse_kfac or a module strategy)"
                )
        out: dict[str, KronModule] = {}
        bias_of: dict[str, str] = {}
        for n in self._blocks:
            inf = self._info[n]
            if inf.module_name is None:
                raise ValueError(
                    f"parameter {n!r} is not the weight or bias of a linear map (nn.Linear / Conv1D); "
                    "Kronecker-factored methods cannot handle it"
                )
            if inf.role == "bias":
                bias_of[inf.module_name] = n
        for n, b in self._blocks.items():
            inf = self._info[n]
            if inf.role != "weight":
                continue
            assert isinstance(b, KronBlock)
            assert inf.module_name is not None
            bias = bias_of.pop(inf.module_name, None)
            bb = b if bias is None else self._blocks[bias]  # a 1-D bias's block: cols=None
            assert isinstance(bb, KronBlock)
            rows = bb.rows
            if rows is not b.rows and (
                rows is None or b.rows is None or not torch.equal(rows, b.rows)
            ):
                raise ValueError(
                    f"bias {bias!r} selects rows {rows}, its weight selects rows {b.rows}; "
                    "Kronecker-factored methods need the bias rows to equal the weight rows"
                )
            n_rows = inf.n_out if b.rows is None else int(b.rows.numel())
            n_cols = inf.n_in if b.cols is None else int(b.cols.numel())
            where = (inf.module_name, n, bias, b.rows, b.cols, inf.n_out, inf.n_in, inf.transposed)
            out[inf.module_name] = KronModule(*where, n_rows, n_cols)
        if bias_of:
            name = next(iter(bias_of.values()))
            raise ValueError(
                f"bias {name!r} is selected without its weight; Kronecker-factored methods need both"
            )
        return out

    # --------------------------------------------------------------------------- counting
    def percent_of(
        self, model: nn.Module, exclude: str | Iterable[str] | None = EMBEDDINGS
    ) -> float:
        """Stochastic entries as a percentage of the model's countable parameters (``exclude``: `countable_parameters`)."""
        self._check_structure(_model_structure(model), f"model {type(model).__name__}")
        return 100.0 * self.num_entries() / countable_parameters(model, exclude)

    def _check_structure(self, info: Mapping[str, _ParamInfo], what: str) -> None:
        if {n: i.shape for n, i in info.items()} != {n: i.shape for n, i in self._info.items()}:
            raise ValueError(
                f"{what} does not have the parameter structure this subset was built for"
            )

    # --------------------------------------------------------------------------- algebra
    def _compatible(self, other: object, op: str) -> Subset:
        check_type(f"the other operand of {op}", other, Subset, "a Subset")
        self._check_structure(other._info, f"cannot {op}: the other subset")
        return other

    def __or__(self, other: Subset) -> Subset:
        other = self._compatible(other, "union")
        blocks: dict[str, Block] = {}
        for n in {*self._blocks, *other._blocks}:
            a, b = self._blocks.get(n), other._blocks.get(n)
            if a is None or b is None or a == b:
                blocks[n] = b if a is None else a
                continue
            ma, mb = self.mask(n), other.mask(n)
            mu = ma | mb
            if torch.equal(mu, ma) and isinstance(a, KronBlock):
                blocks[n] = a
            elif torch.equal(mu, mb) and isinstance(b, KronBlock):
                blocks[n] = b
            else:
                blocks[n] = MaskBlock(mu)
        return self._spawn(blocks)

    def __and__(self, other: Subset) -> Subset:
        other = self._compatible(other, "intersect")
        blocks: dict[str, Block] = {}
        for n in self._blocks:
            if n not in other._blocks:
                continue
            a, b = self._blocks[n], other._blocks[n]
            if isinstance(a, KronBlock) and isinstance(b, KronBlock):
                rows, cols = _meet(a.rows, b.rows), _meet(a.cols, b.cols)
                if (rows is not None and rows.numel() == 0) or (
                    cols is not None and cols.numel() == 0
                ):
                    continue
                blocks[n] = KronBlock(rows, cols)
            else:
                m = self.mask(n) & other.mask(n)
                if bool(m.any()):
                    blocks[n] = MaskBlock(m)
        return self._spawn(blocks)

    def issubset(self, other: Subset) -> bool:
        """Whether every stochastic entry of ``self`` is stochastic in ``other``."""
        other = self._compatible(other, "compare")
        for n in self._blocks:
            if n not in other._blocks:
                return False
            if bool((self.mask(n) & ~other.mask(n)).any()):
                return False
        return True

    def __le__(self, other: Subset) -> bool:
        return self.issubset(other)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Subset):
            return NotImplemented
        return self._blocks.keys() == other._blocks.keys() and all(
            torch.equal(self.mask(n), other.mask(n)) for n in self._blocks
        )

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        kinds = "kronecker" if self.is_kronecker else "mixed/mask"
        return f"Subset({len(self)} parameters, {self.num_entries()} entries, {kinds})"

    # --------------------------------------------------------------------------- JSON
    def to_json(self) -> str:
        """Serialise to JSON (Kron blocks as index lists, masks as flat indices of their True entries)."""
        blocks: dict[str, Any] = {}
        for n, b in self._blocks.items():
            if isinstance(b, KronBlock):
                blocks[n] = {
                    "type": "kron",
                    "rows": None if b.rows is None else b.rows.tolist(),
                    "cols": None if b.cols is None else b.cols.tolist(),
                }
            else:
                blocks[n] = {
                    "type": "mask",
                    "shape": list(b.mask.shape),
                    "indices": b.mask.flatten().nonzero().flatten().tolist(),
                }
        return json.dumps({"format": _FORMAT, "version": _VERSION, "blocks": blocks})

    @classmethod
    def from_json(cls, text: str | bytes, model: nn.Module) -> Subset:
        """Load a Subset saved with :meth:`to_json`, validating it against ``model``.

        Raises:
            TypeError: If ``text`` is not a string, or a field has the wrong JSON type (named, with
                the parameter it belongs to).
            ValueError: Malformed JSON, a missing key (named), non-integer, negative or out-of-range
                indices, or a subset that does not fit ``model``.
        """
        check_type("text", text, (str, bytes, bytearray), "a JSON string")
        try:
            data = json.loads(text)
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ValueError(f"text is not valid JSON: {err}") from err
        got = (data.get("format"), data.get("version")) if isinstance(data, dict) else None
        if got != (_FORMAT, _VERSION):
            raise ValueError(
                f"JSON is not a {_FORMAT} of version {_VERSION} ('format', 'version': {got})"
            )
        if "blocks" not in data:
            raise ValueError("Subset JSON has no 'blocks' key")
        raw = check_type("Subset JSON 'blocks'", data["blocks"], dict, "an object {name: block}")
        blocks = {n: _block_from_json(n, d) for n, d in raw.items()}
        return cls.from_model(model, blocks)


def check_subset(subset: object, empty_ok: bool = True) -> Subset:
    """``subset`` itself if it is a `Subset` (non-empty unless ``empty_ok``), else a ``TypeError`` / ``ValueError``."""
    check_type("subset", subset, Subset, "a partialbayes.selection.Subset")
    if not (empty_ok or subset._blocks):
        raise ValueError("subset is empty: select at least one parameter")
    return subset


def _json_type(value: object) -> str:
    """JSON name of a decoded value's type."""
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean"}
    if value is None:
        return "null"
    return names.get(type(value), f"a number ({value!r})")


def _json_ints(name: str, d: dict[str, Any], key: str, *, nullable: bool) -> list[int] | None:
    """Field ``key`` of a block: a JSON array of non-negative integers (or null when allowed)."""
    if key not in d:
        raise ValueError(f"block of {name!r} has no {key!r} key")
    value = d[key]
    if value is None and nullable:
        return None
    if not isinstance(value, list):
        want = "an array of integers or null" if nullable else "an array of integers"
        raise TypeError(f"{key!r} of block {name!r} must be {want}, got {_json_type(value)}")
    for v in value:
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(
                f"{key!r} of block {name!r} must hold integers, got {_json_type(v)}"
                + (" (indices are never fractional)" if isinstance(v, float) else "")
            )
        if v < 0:
            raise ValueError(f"{key!r} of block {name!r} holds a negative index {v}")
    return value


def _block_from_json(name: str, d: object) -> Block:
    """One block of a Subset's JSON, validated field by field."""
    kind = check_type(f"block of {name!r}", d, dict, "an object").get("type")
    if kind == "kron":
        return KronBlock(
            _json_ints(name, d, "rows", nullable=True), _json_ints(name, d, "cols", nullable=True)
        )
    if kind == "mask":
        shape = _json_ints(name, d, "shape", nullable=False) or []
        indices = _json_ints(name, d, "indices", nullable=False) or []
        flat = torch.zeros(int(torch.Size(shape).numel()), dtype=torch.bool)
        idx = torch.as_tensor(indices, dtype=torch.int64)
        if idx.numel() and int(idx.max()) >= flat.numel():
            raise ValueError(
                f"'indices' of block {name!r} contain {int(idx.max())}, out of range for shape "
                f"{shape} ({flat.numel()} entries)"
            )
        flat[idx] = True
        return MaskBlock(flat.reshape(shape))
    raise ValueError(f"block of {name!r} has unknown type {kind!r} (expected 'kron' or 'mask')")


def _meet(a: Tensor | None, b: Tensor | None) -> Tensor | None:
    """Intersection of two sorted index sets (``None`` = all)."""
    if a is None:
        return b
    if b is None:
        return a
    return a[torch.isin(a, b)]


def countable_named_parameters(
    model: nn.Module, exclude: str | Iterable[str] | None = EMBEDDINGS
) -> dict[str, nn.Parameter]:
    """Countable parameters of ``model`` by name, in model order (see :func:`countable_parameters`)."""
    check_type("model", model, nn.Module, "a torch.nn.Module")
    named = dict(model.named_parameters())
    if exclude is None:
        return named
    if isinstance(exclude, str):
        if exclude != EMBEDDINGS:
            raise ValueError(f"exclude={exclude!r}: use 'embeddings', None, or a list of regexes")
        skip = {
            id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters()
        }
        return {n: p for n, p in named.items() if id(p) not in skip}
    try:
        patterns = list(exclude)
    except TypeError:
        raise TypeError(
            f"exclude must be 'embeddings', None, or a list of regexes, got {type(exclude).__name__}"
        ) from None
    pats = []
    for p in patterns:
        check_type("exclude patterns", p, str, "strings")
        try:
            pats.append(re.compile(p))
        except re.error as err:
            raise ValueError(f"exclude pattern {p!r} is not a valid regex: {err}") from err
    return {n: p for n, p in named.items() if not any(q.search(n) for q in pats)}


def countable_parameters(model: nn.Module, exclude: str | Iterable[str] | None = EMBEDDINGS) -> int:
    """Number of countable parameters of ``model`` (denominator of "percent of parameters").

    ``exclude``: ``"embeddings"`` (default: every ``nn.Embedding`` parameter, as in Kampen et al.), an
    iterable of regexes ``re.search``-ed in parameter names, or ``None`` (count everything).

    Raises:
        ValueError: If nothing is countable or ``exclude`` is an unknown keyword.
    """
    total = sum(p.numel() for p in countable_named_parameters(model, exclude).values())
    if total == 0:
        raise ValueError(
            f"model {type(model).__name__} has no countable parameters (exclude={exclude!r})"
        )
    return total
