"""How much library code one user-level call runs: distinct functions and files under ``packages/*/src``.

A newcomer who follows a call reads these functions. Scenarios (run after one warm-up, so import-time and
first-call-only code does not count):

* ``laplace``: ``KronLaplace(model, subset).fit(loader)`` then ``.predict(batch)`` on a tiny BERT;
* ``ivon``: one ``IVON.step()`` (one sampled forward/backward inside ``sampled_params(train=True)``);
* ``cell``: one S-KFAC cell of a tiny glue-bench grid (``run_grid`` into a fresh results folder: data,
  fine-tuning one epoch of a tiny BERT, the cell, its record), the default ``curvature_pass``.

Other scenarios can be added to ``SCENARIOS`` (a function that returns the callable to trace).

Usage: ``uv run --frozen python tools/call_path.py [laplace|ivon ...] [--list]``.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tiny_models
SRC = str(ROOT / "packages")


def _bert_batches(n: int = 2) -> tuple[torch.nn.Module, list[dict[str, torch.Tensor]]]:
    from tiny_models import tiny_model

    model = tiny_model("bert", seed=0, size="s").eval()
    g = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(n):
        ids = torch.randint(5, 50, (4, 12), generator=g)
        mask = torch.ones_like(ids)
        mask[:, 9:] = 0
        batches.append(
            {
                "input_ids": ids,
                "attention_mask": mask,
                "labels": torch.randint(0, 2, (4,), generator=g),
            }
        )
    return model, batches


def laplace() -> Callable[[], object]:
    from partialbayes.curvature import KronLaplace
    from partialbayes.selection import sparse_kfac

    model, batches = _bert_batches()
    subset = sparse_kfac(model, 10)

    def run() -> object:
        la = KronLaplace(model, subset)
        la.fit(batches)
        return la.predict(batches[0])

    return run


def ivon() -> Callable[[], object]:
    from partialbayes.ivon import IVON

    model, batches = _bert_batches(1)
    model.train()
    opt = IVON(model.parameters(), lr=1e-3, ess=1000)

    def run() -> object:
        opt.zero_grad()
        with opt.sampled_params(train=True):
            out = model(**batches[0])
            out.loss.backward()
        return opt.step()

    return run


def cell() -> Callable[[], object]:
    import string
    import tempfile

    from transformers import BertTokenizerFast

    from partialbayes.glue_bench import Grid, RunConfig, Settings, TrainConfig, run_grid
    from tiny_models import tiny_model

    # silent, as before: the tiny model's warnings (a prior at its grid's edge) are expected here
    logging.getLogger("partialbayes.glue_bench").addHandler(logging.NullHandler())
    root = Path(tempfile.mkdtemp(prefix="call-path-cell-"))
    chars = list(string.ascii_lowercase + string.punctuation)
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *chars, *[f"##{c}" for c in chars]]
    (root / "vocab.txt").write_text("\n".join(vocab) + "\n")
    tokenizer = BertTokenizerFast(vocab=str(root / "vocab.txt"), do_lower_case=True)
    (root / "glue" / "SST-2").mkdir(parents=True)
    rows = ["a charming journey .\t1", "dull and boring\t0", "the best film\t1", "bleak\t0"]
    for part, n in (("train", 48), ("dev", 8)):
        body = "".join(rows[i % 4] + "\n" for i in range(n))
        (root / "glue" / "SST-2" / f"{part}.tsv").write_text("sentence\tlabel\n" + body)
    config = RunConfig(
        model="tiny-bert",
        train=TrainConfig(epochs=1, batch_size=8, max_length=16, lr=1e-3),
        settings=Settings(skfac_percents=(10.0,)),
        max_train_examples=16,
    )
    runs = iter(range(1_000))

    def factory(name: str, num_labels: int, dropout: float) -> tuple[torch.nn.Module, object]:
        return tiny_model("bert", seed=0, size="s", vocab=tokenizer.vocab_size), tokenizer

    def run() -> object:  # a fresh results folder each time: nothing cached
        results = root / f"results-{next(runs)}"
        return run_grid(
            Grid(
                ["sst2"],
                [0],
                ["skfac"],
                config,
                results,
                glue_dir=root / "glue",
                model_factory=factory,
                progress=False,
            ),
        )

    return run


SCENARIOS: dict[str, Callable[[], Callable[[], object]]] = {
    "laplace": laplace,
    "ivon": ivon,
    "cell": cell,
}


def trace(run: Callable[[], object]) -> dict[str, set[str]]:
    """``{file: {function qualname}}`` of every library function called while ``run()`` runs.

    Comprehensions, generator expressions and lambdas are not counted (they are part of their function).
    """
    seen: dict[str, set[str]] = {}

    def hook(frame, event, arg):  # sys.setprofile signature
        if event == "call":
            f = frame.f_code.co_filename
            if f.startswith(SRC) and "/src/" in f and not frame.f_code.co_name.startswith("<"):
                seen.setdefault(f, set()).add(frame.f_code.co_qualname)

    run()  # warm-up: lazy imports and caches
    sys.setprofile(hook)
    try:
        run()
    finally:
        sys.setprofile(None)
    return seen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument(
        "scenarios", nargs="*", choices=[*SCENARIOS, []], help=f"any of {list(SCENARIOS)}"
    )
    parser.add_argument("--list", action="store_true", help="list the functions per file")
    args = parser.parse_args()
    torch.manual_seed(0)
    for name in args.scenarios or list(SCENARIOS):
        seen = trace(SCENARIOS[name]())
        n = sum(len(v) for v in seen.values())
        print(f"{name}: {n} library functions in {len(seen)} files")
        if args.list:
            for f, fns in sorted(seen.items()):
                print(f"  {Path(f).relative_to(SRC)}: {', '.join(sorted(fns))}")


if __name__ == "__main__":
    main()
