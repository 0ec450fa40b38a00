"""What the examples compare: the methods (one `AnisoConfig` each) and the result table."""

from __future__ import annotations

import math
import statistics

METHODS: dict[str, dict] = {
    "mle": dict(method="none"),
    "agg": dict(method="agg", alpha=0.03),
    "cosreg": dict(method="cosreg", reg_weight=1.0),
    "hinge": dict(method="hinge", reg_weight=1.0, hinge_margin=0.5, hinge_sample=256),
    "spectrum": dict(method="spectrum", reg_weight=0.1, spectrum_prior="poly"),
    "lowrank": dict(head="lowrank", lowrank_rank=16),
    "simctg": dict(method="simctg", simctg_weight=1.0, simctg_margin=0.5),
    "uniformity": dict(method="uniformity", uniformity_weight=0.1, uniformity_sample=1024),
    "agg+simctg": dict(method=("agg", "simctg"), alpha=0.03, simctg_weight=1.0),
}

def add_run_arguments(parser) -> None:
    """The flags every example shares: corpus vocabulary, sequence length, steps, batch, model size, seed."""
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--block", type=int, default=64, help="tokens per training sequence")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)


# (label, metric name, measured on the validation set?)
TABLE = [
    ("validation perplexity", "aniso/eval/ppl", True),
    ("  frequent tokens", "aniso/eval/ppl_frequent", True),
    ("  medium tokens", "aniso/eval/ppl_medium", True),
    ("  rare tokens", "aniso/eval/ppl_rare", True),
    ("Uniq (distinct argmax predictions)", "aniso/eval/uniq", True),
    ("I(W) of the head (raw, Wang et al.)", "aniso/geometry/head/isotropy", False),
    ("I(W) of the head (centered)", "aniso/geometry/head/isotropy_centered", False),
    ("I(W) of the rare group", "aniso/frequency/rare/isotropy", False),
    ("mean cosine of the head's rows", "aniso/geometry/head/mean_cosine", False),
    ("mean cosine rare vs frequent rows", "aniso/frequency/rare_frequent_cosine", False),
    ("uniformity of the head rows (Wang & Isola)", "aniso/uniformity/head", False),
    ("uniformity of the last hidden states", "aniso/uniformity/hidden", False),
]


def print_table(title: str, metrics: dict[str, float], eval_prefix: str) -> dict[str, float]:
    """Print the comparison table from `metrics` (validation metrics under `eval_prefix`,
    e.g. "eval_" for the HF Trainer, "val_" for Lightning); returns the rows printed."""
    rows = {label: metrics[(eval_prefix if is_eval else "") + key] for label, key, is_eval in TABLE
            if (eval_prefix if is_eval else "") + key in metrics}
    print(f"\n{title}")
    width = max(len(label) for label, _, _ in TABLE)
    for label, value in rows.items():
        print(f"  {label:<{width}}  {value:.4g}")
    return rows


def mean_std(values: list[float | None]) -> str:
    """"mean ± std" over seeds (sample std; the mean alone for one seed; "n/a" with no finite value)."""
    finite = [v for v in values if v is not None and math.isfinite(v)]
    if not finite:
        return "n/a"
    mean = statistics.fmean(finite)
    return f"{mean:.4g} ± {statistics.stdev(finite):.2g}" if len(finite) > 1 else f"{mean:.4g}"


def summary_table(runs: list[dict], columns: list[tuple[str, str]]) -> str:
    """Markdown: one row per method of `runs` (records with "method" and a "final" metrics dict),
    mean ± std over its seeds of each (label, metric key) column."""
    methods = list(dict.fromkeys(r["method"] for r in runs))
    lines = ["| method | seeds | " + " | ".join(label for label, _ in columns) + " |", "|---|---|" + "---|" * len(columns)]
    for m in methods:
        mine = [r for r in runs if r["method"] == m]
        cells = [mean_std([r["final"].get(key) for r in mine]) for _, key in columns]
        lines.append(f"| {m} | {len(mine)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
