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
    "coupled_adam": dict(method="coupled_adam"),
    "mu_centering": dict(method="mu_centering"),
    "mu_loss": dict(method="mu_loss", mu_loss_weight=1e-4),
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


# (label, metric name, measured on the validation set?, which way is better)
TABLE = [
    ("validation perplexity", "aniso/eval/ppl", True, "↓"),
    ("  frequent tokens", "aniso/eval/ppl_frequent", True, "↓"),
    ("  medium tokens", "aniso/eval/ppl_medium", True, "↓"),
    ("  rare tokens", "aniso/eval/ppl_rare", True, "↓"),
    ("Uniq (distinct argmax predictions)", "aniso/eval/uniq", True, "↑"),
    ("I(W) of the head (raw, Wang et al.)", "aniso/geometry/head/isotropy", False, "↑"),
    ("I(W) of the head (centered)", "aniso/geometry/head/isotropy_centered", False, "↑"),
    ("I(W) of the rare group", "aniso/frequency/rare/isotropy", False, "↑"),
    ("mean cosine of the head's rows", "aniso/geometry/head/mean_cosine", False, "→0"),
    ("mean cosine rare vs frequent rows", "aniso/frequency/rare_frequent_cosine", False, "→0"),
    ("uniformity of the head rows (Wang & Isola)", "aniso/uniformity/head", False, "↓"),
    ("uniformity of the last hidden states", "aniso/uniformity/hidden", False, "↓"),
]
MLE_AT_DEFAULTS = {
    "eval_aniso/eval/ppl": 23.4, "eval_aniso/eval/ppl_frequent": 17.9, "eval_aniso/eval/ppl_medium": 2.24e4,
    "eval_aniso/eval/ppl_rare": 1.761e5, "eval_aniso/eval/uniq": 38, "aniso/geometry/head/isotropy": 0.6039,
    "aniso/geometry/head/isotropy_centered": 0.9678, "aniso/frequency/rare/isotropy": 0.4688,
    "aniso/geometry/head/mean_cosine": 0.5622, "aniso/frequency/rare_frequent_cosine": 0.401,
    "aniso/uniformity/head": -1.266, "aniso/uniformity/hidden": -2.453,
}
"""`python examples/hf_train.py --method mle` with every default (seed 0; torch 2.14.1, transformers
5.24, on a 2-core CPU): the baseline `hf_train.py` prints beside another method's run at the defaults."""
BETTER = {"↓": "lower is better", "↑": "higher is better (1 = isotropic)", "→0": "closer to 0 is better"}


def print_table(title: str, metrics: dict[str, float], eval_prefix: str,
                baseline: dict[str, float] | None = None, baseline_label: str = "MLE") -> dict[str, float]:
    """Print the comparison table from `metrics` (validation metrics under `eval_prefix`,
    e.g. "eval_" for the HF Trainer, "val_" for Lightning), each row with the way it is better
    and, when given, the `baseline` run's value (same names) beside it; returns the rows printed."""
    name = lambda key, is_eval: (eval_prefix if is_eval else "") + key  # noqa: E731
    rows = {label: metrics[name(key, e)] for label, key, e, _ in TABLE if name(key, e) in metrics}
    print(f"\n{title}")
    width = max(len(label) for label, _, _, _ in TABLE)
    head = f"  {'':<{width}}  {'':>2}  {'this run':>10}" + (f"  {baseline_label:>10}" if baseline else "")
    print(head)
    for label, key, is_eval, better in TABLE:
        if label not in rows:
            continue
        other = "" if not baseline else f"  {baseline.get(name(key, is_eval), float('nan')):>10.4g}"
        print(f"  {label:<{width}}  {better:>2}  {rows[label]:>10.4g}{other}")
    print("  " + "; ".join(f"{arrow} {meaning}" for arrow, meaning in BETTER.items()))
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
