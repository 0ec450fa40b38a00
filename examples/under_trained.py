"""Does AGG leave fewer under-trained tokens than MLE? The HF example (examples/hf_train.py: a
tiny tied GPT-2 on Python's help text) with the live ``under_trained`` metric, MLE and AGG, three
seeds each; the reference tokens are the vocabulary words that never occur as a training target
(those only in the validation tenth of the text).

    python examples/under_trained.py --output-dir docs/results/under_trained

Prints mean ± std over seeds of the suspected count, the reference size and the mean scores,
and writes runs.json and under_trained.md into --output-dir (docs/results.md §6).
A smoke run: --steps 8 --seeds 0 --vocab-size 512.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from comparison import METHODS, add_run_arguments
from hf_train import train

KEYS = ("suspected", "reference", "mean_score", "reference_mean_score")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_arguments(p)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--output-dir", default="under_trained_out")
    p.add_argument("--text-file", default=None)
    a = p.parse_args(argv)
    out = Path(a.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    runs = []
    for method in ("mle", "agg"):
        for seed in a.seeds:
            run_args = argparse.Namespace(**{**vars(a), "seed": seed, "output_dir": None})
            config = {**METHODS[method], "metrics": ("eval", "under_trained")}
            _, metrics, _, _ = train(config, run_args, disable_tqdm=True)
            row = {"method": method, "seed": seed, **{k: metrics[f"aniso/under_trained/{k}"] for k in KEYS},
                   "ppl": metrics.get("eval_aniso/eval/ppl")}
            runs.append(row)
            print(json.dumps(row), flush=True)
            (out / "runs.json").write_text(json.dumps(runs, indent=1) + "\n")
    lines = ["| | " + " | ".join(KEYS) + " | validation ppl |", "|---|" + "---:|" * (len(KEYS) + 1)]
    for method in ("mle", "agg"):
        rows = [r for r in runs if r["method"] == method]
        cells = [_mean_std([r[k] for r in rows]) for k in (*KEYS, "ppl")]
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    table = "\n".join(lines) + "\n"
    (out / "under_trained.md").write_text(table)
    print(table)


def _mean_std(values: list[float]) -> str:
    values = [v for v in values if v is not None]
    if not values:
        return "–"
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.4g} ± {sd:.2g}"


if __name__ == "__main__":
    main()
