"""One streamed curvature pass for a whole ramp: the factors of every cell of one (task, split).

Every KFAC / S-KFAC / module-ramp cell of a (task, split) shares the fine-tuned model and the training set.
A whole module's factors are its full KFAC factors ``G ⊗ A``; an S-KFAC level's are the principal
sub-blocks ``G[R, R]``, ``A[C, C]`` of the full ones. Taking those sub-blocks from the full factors is exact
in exact arithmetic but **not bit for bit**: a fresh fit multiplies the gathered ``δ[:, R]`` and ``x[:, C]``,
and BLAS sums a small product in another order than a large one (MKL, measured: relative differences of
1e-16 in a few modules per level). So the pass computes, in the same forward and backward passes over
the training set, the full factors of every linear map a module cell needs **and** the factors of every
S-KFAC level a cell needs, each accumulated exactly as a fresh fit accumulates it — by the curvature
library itself: one call of ``partialbayes.curvature.kfac`` on a thin wrapper of the model in which each
S-KFAC level of each linear map is a "tap", a stand-in linear map that receives the real map's input and
returns its very output tensor, so the library's hooks see the same ``x`` and ``δ`` for the tap as for the
real map and gather the level's rows and columns from them. The extra accumulation costs
``B (|R|² + |C|²)`` per level, map and batch, far below the forward and backward passes it shares
(Table 3's fourteen levels hold 32 % of the full factors' floats).

The parts (one per linear map, one per S-KFAC level) are stored beside the checkpoint, one safetensors file
each with its JSON metadata in the header, written atomically; a later run (a resumed one, or one asking
for more cells) loads the parts it finds and computes only the missing ones.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor, nn

from partialbayes.curvature import ModuleFactors, kfac
from partialbayes.glue_bench.store import atomic_write
from partialbayes.selection import KronBlock, Subset, linear_modules

# What a fresh ``KronLaplace(model, subset, num_classes=C, fisher=...).fit(train)`` passes to ``kfac``
# besides the fisher type: the pass must use the same options to give the same factors.
KFAC_OPTIONS: dict[str, Any] = {
    "likelihood": "classification",
    "mc_samples": 1,
    "sharing": "reduce",
    "bias": "fold",
    "sigma_noise": 1.0,
    "dtype": torch.float64,
}
FORMAT = 1


@dataclass(frozen=True)
class TrainingLoss:
    """The training loss at the MAP seen by the pass (what ``KronLaplace.fit_curvature`` needs).

    Attributes:
        map_loss: Summed cross-entropy over the training set (nats).
        n_data: Number of training examples.
        n_outputs: Number of logits.
    """

    map_loss: float
    n_data: int
    n_outputs: int

    def agrees(self, other: TrainingLoss) -> bool:
        """Same data and the same loss up to rounding.

        Parts written by separate processes on a device whose kernels are not bit-reproducible may differ
        in the last bits; on one CPU the passes agree exactly.
        """
        return (self.n_data, self.n_outputs) == (other.n_data, other.n_outputs) and math.isclose(
            self.map_loss, other.map_loss, rel_tol=1e-6
        )


class _LossObserver:
    """``on_batch`` observer summing the cross-entropy in float64 as ``KronLaplace.fit`` does."""

    def __init__(self) -> None:
        self.total: Tensor | None = None
        self.n_data = 0
        self.n_outputs = 0

    def __call__(self, index: int, logits: Tensor, labels: Tensor | None) -> None:
        if labels is None:
            raise ValueError(f"training batch {index} has no labels")
        f = logits.detach().double()
        loss = nn.functional.cross_entropy(f, labels, reduction="sum")
        self.total = loss if self.total is None else self.total + loss
        self.n_data += int(f.shape[0])
        self.n_outputs = int(f.shape[1])

    def result(self) -> TrainingLoss:
        if self.total is None:
            raise ValueError("the training loader is empty")
        total = torch.stack(
            [self.total.cpu(), torch.tensor(float(self.n_data), dtype=torch.float64)]
        )
        return TrainingLoss(float(total[0]), self.n_data, self.n_outputs)


# ------------------------------------------------------------------------------------------ taps
def _mangle(name: str) -> str:
    return name.replace(".", "__") or "__root__"


def _make_tap(real: nn.Module, transposed: bool) -> nn.Module:
    """A stand-in of ``real`` that takes no memory: same weight (and bias) shapes, returns ``_out``.

    The weight and bias are zero-strided views; the library's hooks only read the module's input and
    output and the shapes of its parameters. A transposed map (Hugging Face ``Conv1D``, stored n_in x n_out)
    gets a look-alike that ``selection`` recognises by its class name.
    """
    w = cast(Tensor, real.weight)
    zero = torch.zeros((), dtype=w.dtype, device=w.device)
    bias = cast("Tensor | None", getattr(real, "bias", None))
    tap: _Tap
    if transposed:
        tap = type("Conv1D", (_Tap,), {})()
        setattr(tap, "nf", int(w.shape[1]))  # noqa: B010 - a plain attribute, as Conv1D has
    else:
        tap = _LinearTap()
        tap.out_features, tap.in_features = int(w.shape[0]), int(w.shape[1])
    tap.weight = nn.Parameter(zero.expand(w.shape), requires_grad=False)
    tap.bias = None if bias is None else nn.Parameter(zero.expand(bias.shape), requires_grad=False)
    return tap


class _Tap(nn.Module):
    """Returns the output tensor handed to it (``_out``), whatever its input."""

    weight: nn.Parameter
    bias: nn.Parameter | None

    def __init__(self) -> None:
        nn.Module.__init__(self)  # not super(): a linear tap must not run nn.Linear.__init__
        self._out: Tensor | None = None

    def forward(self, x: Tensor) -> Tensor:
        out, self._out = self._out, None
        if out is None:
            raise RuntimeError("curvature tap called outside its linear map's forward pass")
        return out


class _LinearTap(_Tap, nn.Linear):  # type: ignore[misc]
    """A tap that ``isinstance(…, nn.Linear)`` recognises (``selection.linear_modules``)."""

    def __init__(self) -> None:  # nn.Linear's own __init__ would allocate a weight
        _Tap.__init__(self)

    def forward(self, x: Tensor) -> Tensor:
        return _Tap.forward(self, x)


class _Tapped(nn.Module):
    """The model plus one tap per (S-KFAC level, linear map); ``forward`` is the model's."""

    def __init__(self, model: nn.Module, levels: Sequence[Subset]) -> None:
        super().__init__()
        self.model = model
        self.levels = nn.ModuleList()
        lin = linear_modules(model)
        self.taps: dict[str, list[nn.Module]] = {}
        for subset in levels:
            taps = nn.ModuleDict()
            for m, km in subset.kron_modules().items():
                tap = _make_tap(lin[m], km.transposed)
                taps[_mangle(m)] = tap
                self.taps.setdefault(m, []).append(tap)
            self.levels.append(taps)
        self._lin = {m: lin[m] for m in self.taps}

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.model(*args, **kwargs)

    @contextmanager
    def hooked(self) -> Iterator[None]:
        """While active, every call of a tapped linear map also calls its taps with its input and output."""

        def hook(
            module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any
        ) -> None:
            x = args[0] if args else kwargs.get("input", kwargs.get("x"))
            for tap in self.taps[names[id(module)]]:
                tap._out = out
                tap(x)

        names = {id(mod): m for m, mod in self._lin.items()}
        handles = [mod.register_forward_hook(hook, with_kwargs=True) for mod in self._lin.values()]
        try:
            yield
        finally:
            for h in handles:
                h.remove()


def compute_pass(
    model: nn.Module,
    batches: Iterable[Any],
    modules: Sequence[str],
    levels: Mapping[float, Subset],
    *,
    fisher: str,
    num_classes: int,
    generator: torch.Generator | None = None,
) -> tuple[dict[str, ModuleFactors], dict[float, dict[str, ModuleFactors]], TrainingLoss]:
    """Full factors of ``modules`` and the factors of every S-KFAC level, in one pass over ``batches``.

    Args:
        model: The fine-tuned classifier (eval mode).
        batches: Training batches (dicts with ``labels``), read once.
        modules: Linear maps whose full factors (weight and bias, bias folded) are wanted.
        levels: ``{percent: S-KFAC subset}`` (``selection.sparse_kfac``) whose factors are wanted.
        fisher: ``empirical``, ``exact`` or ``mc``.
        num_classes: Number of logits.
        generator: The MC-fisher generator (same seed as a fresh fit's, same sampled labels).

    Returns:
        ``(full, by_level, loss)``: ``{module: ModuleFactors}``, ``{percent: {module: ModuleFactors}}`` (the
        factors ``kfac`` returns for those subsets, bit for bit) and the training loss at the MAP.

    Raises:
        ValueError: Nothing to compute, or the curvature library refuses the data.
    """
    if not modules and not levels:
        raise ValueError("compute_pass: no module and no S-KFAC level asked for")
    percents = list(levels)
    tapped = _Tapped(model, [levels[p] for p in percents]).eval()
    lin = linear_modules(model)
    blocks: dict[str, KronBlock] = {}
    for m in modules:
        blocks[f"model.{m}.weight" if m else "model.weight"] = KronBlock()
        if getattr(lin[m], "bias", None) is not None:
            blocks[f"model.{m}.bias" if m else "model.bias"] = KronBlock()
    owner: dict[str, tuple[float | None, str]] = {
        f"model.{m}" if m else "model": (None, m) for m in modules
    }
    for i, p in enumerate(percents):
        for m, km in levels[p].kron_modules().items():
            name = f"levels.{i}.{_mangle(m)}"
            blocks[f"{name}.weight"] = KronBlock(km.rows, km.cols)
            if km.bias_name is not None:
                blocks[f"{name}.bias"] = KronBlock(km.rows)
            owner[name] = (p, m)
    union = Subset.from_model(tapped, blocks)
    loss = _LossObserver()
    with tapped.hooked():
        factors = kfac(
            tapped,
            batches,
            union,
            fisher=fisher,
            generator=generator,
            num_classes=num_classes,
            on_batch=loss,
            **KFAC_OPTIONS,
        )
    full: dict[str, ModuleFactors] = {}
    by_level: dict[float, dict[str, ModuleFactors]] = {p: {} for p in percents}
    for name, f in factors.items():
        level, m = owner[name]
        f = dataclasses.replace(f, module=m)
        if level is None:
            full[m] = f
        else:
            by_level[level][m] = f
    return full, by_level, loss.result()


# ------------------------------------------------------------------------------------------ storage
def weights_digest(model: nn.Module) -> str:
    """sha256 of every parameter of ``model`` (names, shapes, dtypes and bytes): the MAP's identity."""
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        t = p.detach().cpu().contiguous()
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


class CurvatureStore:
    """The stored parts of the curvature pass of one (task, split): one file per linear map and per level.

    Args:
        folder: Where the parts live (beside the checkpoint).
        key: What the factors depend on besides the data (fisher type, the MAP's digest, the batches, ...);
            a part written under another key is refused.
    """

    def __init__(self, folder: Path, key: Mapping[str, Any]) -> None:
        self.key = dict(key)
        digest = hashlib.sha256(json.dumps(self.key, sort_keys=True).encode()).hexdigest()[:16]
        self.folder = Path(folder) / f"{self.key.get('fisher', 'kfac')}-{digest}"

    def module_path(self, module: str) -> Path:
        """File of the full factors of ``module``."""
        return self.folder / f"module-{_safe(module)}.safetensors"

    def level_path(self, percent: float) -> Path:
        """File of the factors of S-KFAC level ``percent``."""
        return self.folder / f"skfac-{percent:g}.safetensors"

    def missing(
        self, modules: Iterable[str], percents: Iterable[float]
    ) -> tuple[list[str], list[float]]:
        """The modules and levels without a stored part."""
        return (
            [m for m in dict.fromkeys(modules) if not self.module_path(m).is_file()],
            [p for p in dict.fromkeys(percents) if not self.level_path(p).is_file()],
        )

    def save(
        self,
        full: Mapping[str, ModuleFactors],
        by_level: Mapping[float, Mapping[str, ModuleFactors]],
        loss: TrainingLoss,
    ) -> list[Path]:
        """Write one part per module and per level, each atomically; returns the files written."""
        self.folder.mkdir(parents=True, exist_ok=True)
        written = []
        for m, f in full.items():
            tensors = {"G": f.G, "A": f.A}
            meta = {"kind": "module", "module": m, "bias": f.bias, "n_examples": f.n_examples}
            written.append(self._write(self.module_path(m), tensors, meta, loss))
        for p, factors in by_level.items():
            tensors = {}
            mods = {}
            for m, f in factors.items():
                tensors.update({f"{m}:G": f.G, f"{m}:A": f.A})
                tensors[f"{m}:rows"] = f.rows if f.rows is not None else torch.empty(0)
                tensors[f"{m}:cols"] = f.cols if f.cols is not None else torch.empty(0)
                mods[m] = {"bias": f.bias, "n_examples": f.n_examples}
            meta = {"kind": "skfac", "percent": p, "modules": mods}
            written.append(self._write(self.level_path(p), tensors, meta, loss))
        return written

    def _write(
        self, path: Path, tensors: Mapping[str, Tensor], meta: dict[str, Any], loss: TrainingLoss
    ) -> Path:
        header = {
            "format": FORMAT,
            "key": self.key,
            "loss": dataclasses.asdict(loss),
            **meta,
        }
        cpu = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
        metadata = {"partialbayes": json.dumps(header, sort_keys=True)}
        return atomic_write(path, lambda tmp: save_file(cpu, str(tmp), metadata=metadata))

    def _read(self, path: Path, kind: str) -> tuple[dict[str, Tensor], dict[str, Any]]:
        try:
            with safe_open(str(path), framework="pt") as fh:
                header = json.loads((fh.metadata() or {})["partialbayes"])
                tensors = {k: fh.get_tensor(k) for k in fh.keys()}  # noqa: SIM118 - not a dict
        except (
            Exception
        ) as err:  # SafetensorError, KeyError, JSONDecodeError, OSError: name the file
            raise ValueError(
                f"curvature part {path} cannot be read ({type(err).__name__}: {err}); delete it to "
                "recompute it"
            ) from err
        if header.get("format") != FORMAT or header.get("kind") != kind:
            raise ValueError(f"curvature part {path} is not a {kind} part of format {FORMAT}")
        if header.get("key") != self.key:
            raise ValueError(
                f"curvature part {path} was computed for {header.get('key')}, not for {self.key}; "
                "delete it to recompute it"
            )
        return tensors, header

    def load(
        self, modules: Iterable[str], percents: Iterable[float]
    ) -> tuple[dict[str, ModuleFactors], dict[float, dict[str, ModuleFactors]], TrainingLoss]:
        """Load stored parts: ``(full, by_level, loss)`` as :func:`compute_pass` returns them.

        Raises:
            ValueError: A part is missing, damaged, computed under another key, or the parts disagree
                on the training loss (they come from different passes over different data).
        """
        losses: list[TrainingLoss] = []
        full: dict[str, ModuleFactors] = {}
        for m in dict.fromkeys(modules):
            tensors, header = self._read(self.module_path(m), "module")
            if header.get("module") != m:
                raise ValueError(
                    f"curvature part {self.module_path(m)} holds {header.get('module')}"
                )
            full[m] = ModuleFactors(
                m, tensors["G"], tensors["A"], None, None, header["bias"], header["n_examples"]
            )
            losses.append(TrainingLoss(**header["loss"]))
        by_level: dict[float, dict[str, ModuleFactors]] = {}
        for p in dict.fromkeys(percents):
            tensors, header = self._read(self.level_path(p), "skfac")
            level = {}
            for m, info in header["modules"].items():
                rows, cols = tensors[f"{m}:rows"], tensors[f"{m}:cols"]
                level[m] = ModuleFactors(
                    m,
                    tensors[f"{m}:G"],
                    tensors[f"{m}:A"],
                    rows if rows.numel() else None,
                    cols if cols.numel() else None,
                    info["bias"],
                    info["n_examples"],
                )
            by_level[p] = level
            losses.append(TrainingLoss(**header["loss"]))
        if not losses:
            raise ValueError("CurvatureStore.load: no module and no level asked for")
        if not all(loss.agrees(losses[0]) for loss in losses):
            raise ValueError(
                f"curvature parts under {self.folder} disagree on the training loss ({set(losses)}): they "
                "come from different passes; delete the folder to recompute them"
            )
        return full, by_level, losses[0]


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", name) or "_root_"
