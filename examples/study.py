"""The reproduction study: every method on one corpus and one tiny model, several seeds, side by
side (docs/results.md).

    python examples/study.py                      # the full study: every method x 3 seeds
    python examples/study.py --quick              # a smoke run: 3 methods x 1 seed, few steps
    python examples/study.py --remedies           # the ranking of every training remedy (docs/results.md §9)

Each run is the HF example (examples/hf_train.py: a tiny tied GPT-2 on Python's help text with
a word-level vocabulary, through the real `transformers.Trainer` and one `AnisoCallback`), with
the gradient-bottleneck probe on. Per run: validation perplexity overall and per frequency
group, Uniq, I(W) raw and centred, I(W) of the rare group, mean cosine, rare-frequent cosine,
effective rank, ‖μ‖ / mean‖e_i‖, the lost fraction, the validation loss per frequency-rank
bucket of the targets (`BUCKETS`), training and wall time; and the trajectories of I(W), mean cosine and the
rare group's I(W) over the logged steps. Writes into ``--output-dir``: ``runs.json`` (every
run), ``study.md`` (mean ± std over seeds per method), and the plots ``trajectories.png``
(I(W) and mean cosine against the step, every method), ``rare_isotropy.png`` (the rare group's
I(W) over training, AGG paper Figure 2's quantity), ``groups.png`` (each frequency group's
I(W) and the rare-frequent cosine over training for MLE, Freeze and AGG), ``tradeoff.png`` (perplexity against I(W)),
``projections.png`` (each method's head rows on their top two singular directions, seed 0) and,
through the report module (`aniso_plugins.offline.report`, the corpus as its text), ``report/`` with
``spectrum.png``, ``projection.png`` (rows coloured by frequency group), ``cosines.png``,
``layers.png`` and ``norm_frequency.png`` of the final MLE and AGG models (seed 0, saved in
``models/``). ``runs.json`` is written after every run; running the same command again resumes
(``--fresh`` starts over).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path

import torch
from comparison import add_run_arguments, summary_table
from hf_train import train

# name -> AnisoConfig fields; every run also measures the bottleneck probe
STUDY: dict[str, dict] = {
    "mle": dict(method="none"),
    "agg": dict(method="agg", alpha=0.03),
    # alpha per the official WikiText-103 recipe's tokens per update (4096 x update-freq 8), not per this run's 1008
    "agg, alpha per 32768 tokens": dict(method="agg", alpha=0.03, alpha_tokens=32768),
    "agg, no g1": dict(method="agg", alpha=0.03, agg_g1=False),
    "agg, no g2": dict(method="agg", alpha=0.03, agg_g2=False),
    "agg, static grouping": dict(method="agg", alpha=0.03, agg_static_after=100),  # fixed after 1 epoch (Table 9)
    "freeze rare": dict(method="agg", alpha=0.03, agg_freeze_rare=True),
    "cosreg": dict(method="cosreg", reg_weight=1.0),
    "hinge": dict(method="hinge", reg_weight=1.0, hinge_margin=0.5, hinge_sample=256),
    "spectrum": dict(method="spectrum", reg_weight=0.1, spectrum_prior="poly"),
    "simctg": dict(method="simctg", simctg_weight=1.0, simctg_margin=0.5),
    "uniformity": dict(method="uniformity", uniformity_weight=0.1, uniformity_sample=1024),
    "untied head": dict(head="untie"),
    # r < d = 64: a rank-64 factor of a width-64 model is no bottleneck (the library refuses it)
    **{f"low-rank r={r}": dict(head="lowrank", lowrank_rank=r) for r in (8, 16, 32)},
    "coupled adam": dict(method="coupled_adam"),  # the paper's defaults: s = 1, the embedding not decayed
    "mu-centering": dict(method="mu_centering"),
    "mu-loss": dict(method="mu_loss", mu_loss_weight=1e-4),  # the paper's λ
    "mu-loss, λ=1": dict(method="mu_loss", mu_loss_weight=1.0),  # 10^4 x the paper's: whether it acts at all here
}
# the ranking of docs/results.md §9: every training remedy, each at its paper's (or the recipe's) setting
REMEDIES = (
    "mle", "agg", "agg, alpha per 32768 tokens", "cosreg", "hinge", "spectrum", "untied head", "low-rank r=16",
    "coupled adam", "mu-centering", "mu-loss", "mu-loss, λ=1",
)
BUCKETS = ((1, 100), (100, 500), (500, 2500), (2500, 4096), (4096, None))
"""Frequency-rank buckets of the target ids (ids are ranks: 1 the most frequent word; 0, <unk>, in
none: it stands for every word outside the vocabulary, so that buckets compare across vocabulary
sizes; 2500-4096 holds the same words in a vocabulary of 4096 and of 8192). Chung & Kim 2025 find a
larger vocabulary's gain almost only on the 2,500 most frequent words."""
QUICK = ("mle", "agg", "simctg")
REPORTED = ("mle", "agg")  # seed 0 of these is saved and compared through the report module

# (label, key in a run's final metrics); eval metrics carry the Trainer's "eval_" prefix
COLUMNS = [
    ("ppl", "eval_aniso/eval/ppl"),
    ("ppl frequent", "eval_aniso/eval/ppl_frequent"),
    ("ppl medium", "eval_aniso/eval/ppl_medium"),
    ("ppl rare", "eval_aniso/eval/ppl_rare"),
    ("Uniq", "eval_aniso/eval/uniq"),
    ("I(W)", "aniso/geometry/head/isotropy"),
    ("I(W) centred", "aniso/geometry/head/isotropy_centered"),
    ("I(W) rare", "aniso/frequency/rare/isotropy"),
    ("mean cosine", "aniso/geometry/head/mean_cosine"),
    ("rare-frequent cosine", "aniso/frequency/rare_frequent_cosine"),
    ("effective rank", "aniso/geometry/head/effective_rank"),
    ("‖μ‖ ratio", "aniso/geometry/head/mean_norm_ratio"),
    ("lost fraction", "aniso/bottleneck/lost_fraction"),
    ("train (s)", "train_s"),
    ("wall (s)", "wall_s"),
]
BUCKET_COLUMNS = [(f"loss ranks {lo}-{hi or 'V'}", f"bucket/{lo}-{hi or 'V'}") for lo, hi in BUCKETS]
TRAJECTORIES = (
    "aniso/geometry/head/isotropy", "aniso/geometry/head/mean_cosine", "aniso/frequency/rare/isotropy",
    "aniso/frequency/medium/isotropy", "aniso/frequency/frequent/isotropy", "aniso/frequency/rare_frequent_cosine",
    "aniso/bottleneck/lost_fraction",
)  # fmt: skip


def one_run(name: str, seed: int, a: argparse.Namespace) -> tuple[dict, object]:
    """Train `name` with `seed`; returns its record and the trained model."""
    run_args = argparse.Namespace(**{**vars(a), "seed": seed, "output_dir": None})
    method = {**STUDY[name], "metrics": ("geometry", "frequency", "eval", "bottleneck")}
    start = time.perf_counter()
    trainer, metrics, _, _ = train(method, run_args, prefix="aniso_study_", disable_tqdm=True)
    wall = time.perf_counter() - start
    runtime = [row["train_runtime"] for row in trainer.state.log_history if "train_runtime" in row]
    metrics = {**metrics, **bucket_losses(trainer.model, trainer.eval_dataset), "train_s": runtime[-1] if runtime else math.nan}
    history = {
        key: [(row["step"], row[key]) for row in trainer.state.log_history if key in row] for key in TRAJECTORIES
    }
    record = {"method": name, "seed": seed, "wall_s": wall, "final": {**metrics, "wall_s": wall}, "history": history}
    return record, trainer.model


def bucket_losses(model, dataset) -> dict[str, float]:
    """Mean validation cross-entropy (nats) of the targets in each of `BUCKETS`, and each bucket's
    share of the targets, as ``bucket/<lo>-<hi>`` and ``bucket_share/<lo>-<hi>``."""
    import torch.nn.functional as F

    sums = torch.zeros(len(BUCKETS), dtype=torch.float64)
    counts = torch.zeros(len(BUCKETS), dtype=torch.float64)
    model.eval()
    with torch.no_grad():
        for start in range(0, len(dataset), 32):
            batch = torch.utils.data.default_collate([dataset[i] for i in range(start, min(start + 32, len(dataset)))])
            ids = batch["input_ids"].to(model.device)
            logits = model(input_ids=ids).logits[:, :-1].flatten(0, 1).double()
            targets = ids[:, 1:].flatten()
            loss = F.cross_entropy(logits, targets, reduction="none").cpu()
            for k, (lo, hi) in enumerate(BUCKETS):
                inside = (targets.cpu() >= lo) & (targets.cpu() < (hi or 1 << 62))
                sums[k] += loss[inside].sum()
                counts[k] += inside.sum()
    names = [f"{lo}-{hi or 'V'}" for lo, hi in BUCKETS]
    return {**{f"bucket/{n}": float(sums[k] / counts[k]) if counts[k] else math.nan for k, n in enumerate(names)},
            **{f"bucket_share/{n}": float(counts[k] / counts.sum()) for k, n in enumerate(names)}}


def plots(runs: list[dict], directory: Path) -> list[str]:
    """trajectories.png, rare_isotropy.png, groups.png, tradeoff.png (seed-mean curves and points)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = list(dict.fromkeys(r["method"] for r in runs))
    colors = plt.cm.tab20.colors[::2] + plt.cm.tab20.colors[1::2]  # ten hues, then their light shades
    palette = dict(zip(methods, colors))  # one colour per method (up to 20)

    def curve(method: str, key: str) -> tuple[list[int], list[float]]:
        series = [dict(r["history"][key]) for r in runs if r["method"] == method]
        steps = sorted(set.intersection(*(set(s) for s in series))) if series else []
        return steps, [statistics.fmean(s[t] for s in series) for t in steps]

    written = []
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for m in methods:
        for ax, key in zip(axes, TRAJECTORIES[:2]):
            ax.plot(*curve(m, key), marker=".", color=palette[m], label=m)
    axes[0].set(xlabel="optimizer step", ylabel="I(W) of the head (raw)", title="Isotropy over training")
    axes[1].set(xlabel="optimizer step", ylabel="mean cosine of the head rows", title="Mean cosine over training")
    axes[1].legend(fontsize=7, ncol=2)
    written.append(_save(fig, plt, directory / "trajectories.png"))

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for m in methods:
        ax.plot(*curve(m, TRAJECTORIES[2]), marker=".", color=palette[m], label=m)
    ax.set(xlabel="optimizer step", ylabel="I(W) of the rare group", title="Rare tokens' isotropy over training")
    ax.legend(fontsize=7, ncol=2)
    written.append(_save(fig, plt, directory / "rare_isotropy.png"))

    shown = [m for m in ("mle", "freeze rare", "agg") if m in methods]
    if shown:  # AGG paper Figure 2's view: each group's I(W) and the rare-frequent cosine over training
        fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
        for color, m in zip(("tab:red", "tab:green", "tab:blue"), shown):
            for group, style in (("frequent", "-"), ("medium", "--"), ("rare", ":")):
                axes[0].plot(*curve(m, f"aniso/frequency/{group}/isotropy"), style, color=color, label=f"{m}, {group}")
            axes[1].plot(*curve(m, "aniso/frequency/rare_frequent_cosine"), color=color, marker=".", label=m)
        axes[0].set(xlabel="optimizer step", ylabel="I(W) of the group's rows", title="Isotropy per frequency group")
        axes[1].set(xlabel="optimizer step", ylabel="mean cosine, rare vs frequent rows", title="Rare-frequent similarity")
        axes[0].legend(fontsize=7, ncol=len(shown))
        axes[1].legend(fontsize=8)
        written.append(_save(fig, plt, directory / "groups.png"))

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for m in methods:
        mine = [r["final"] for r in runs if r["method"] == m]
        x = [f.get("aniso/geometry/head/isotropy", math.nan) for f in mine]
        y = [f.get("eval_aniso/eval/ppl", math.nan) for f in mine]
        ax.scatter(x, y, color=palette[m], label=m)
    ax.set(xlabel="I(W) of the head (raw)", ylabel="validation perplexity", title="Perplexity against isotropy")
    ax.legend(fontsize=7, ncol=2)
    written.append(_save(fig, plt, directory / "tradeoff.png"))
    return written


def _save(fig, plt, path: Path) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


def save_projection(model, path: Path) -> None:
    """The head rows on their top two right singular vectors (raw W, so the common direction shows)."""
    import numpy as np

    w = model.get_output_embeddings().weight.detach().double()
    _, _, vt = torch.linalg.svd(w, full_matrices=False)
    path.parent.mkdir(parents=True, exist_ok=True)
    np.save(path, (w @ vt[:2].T).numpy())


def projection_grid(methods: list[str], directory: Path) -> list[str]:
    """projections.png: one panel per method (seed 0), the head rows on their top two singular
    directions, coloured by frequency rank (ids are ranks: id 1 the most frequent word), each
    direction's sign chosen so that the 100 most frequent rows lie on its positive side."""
    if not methods:
        return []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    cols = min(4, len(methods))
    rows = -(-len(methods) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols + 0.8, 3.0 * rows), squeeze=False)
    for ax, m in zip(axes.flat, methods):
        xy = np.load(directory / "projections" / f"{m}.npy")
        xy = xy * np.where(xy[1:101].mean(0) < 0, -1.0, 1.0)  # a direction's sign is arbitrary: frequent rows right / up
        points = ax.scatter(xy[:, 0], xy[:, 1], c=np.log10(np.arange(1, len(xy) + 1)), s=2, cmap="viridis")
        ax.axhline(0, color="0.8", lw=0.5)
        ax.axvline(0, color="0.8", lw=0.5)
        ax.set_title(m, fontsize=9)
        ax.tick_params(labelsize=7)
    for ax in list(axes.flat)[len(methods):]:
        ax.axis("off")
    fig.suptitle("head rows on their top two singular directions (seed 0); colour: log10 frequency rank", fontsize=10)
    fig.tight_layout(rect=(0, 0, 0.93, 1))
    fig.colorbar(points, cax=fig.add_axes((0.945, 0.15, 0.012, 0.7)))
    path = directory / "projections.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [str(path)]


def settings_of(a: argparse.Namespace) -> dict:
    """What makes two runs of one method and seed the same run (for resuming)."""
    keys = ("steps", "vocab_size", "block", "batch_size", "d_model", "layers", "text_file")
    return {k: getattr(a, k) for k in keys}


def load_done(path: Path, settings: dict) -> list[dict]:
    """The runs already in `path` made with `settings` (an interrupted study resumes from them)."""
    if not path.exists():
        return []
    try:
        runs = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise SystemExit(f"cannot resume from {path} ({e}); move it away or pick another --output-dir") from None
    return [r for r in runs if r.get("settings") == settings]


def save_runs(path: Path, runs: list[dict], done: dict[tuple[str, int], dict]) -> None:
    """Write `runs` and every earlier run not among them (other methods or seeds, or runs of this
    plan not reached yet), so that no finished run is ever dropped from `path`."""
    have = {(r["method"], r["seed"]) for r in runs}
    path.write_text(json.dumps(runs + [r for k, r in done.items() if k not in have], indent=1))


def main(argv: list[str] | None = None) -> list[str]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--methods", nargs="+", choices=sorted(STUDY), default=None, help="default: all")
    p.add_argument("--remedies", action="store_true", help="the methods of the remedies ranking (docs/results.md §9)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--text-file", default=None, help="train on this UTF-8 text instead of Python's help topics")
    p.add_argument("--output-dir", default="study_out")
    p.add_argument("--quick", action="store_true", help="smoke run: mle, agg, simctg (or --methods), 1 seed, 16 steps, V=512")
    p.add_argument("--fresh", action="store_true", help="ignore the runs already in --output-dir/runs.json")
    add_run_arguments(p)
    a = p.parse_args(argv)
    methods = a.methods or (list(REMEDIES) if a.remedies else list(STUDY))
    if a.quick:
        methods, a.seeds = a.methods or list(QUICK), [0]
        a.steps, a.vocab_size, a.batch_size, a.block = 16, 512, 8, 32
    directory = Path(a.output_dir)
    directory.mkdir(parents=True, exist_ok=True)
    settings = settings_of(a)
    plan = [(m, s) for m in methods for s in a.seeds]
    done = {} if a.fresh else {(r["method"], r["seed"]): r for r in load_done(directory / "runs.json", settings)}
    if done:
        print(f"resuming: {sum(k in done for k in plan)} of {len(plan)} runs already in {directory / 'runs.json'}")
    runs = []
    started = time.perf_counter()
    for i, (m, seed) in enumerate(plan, 1):
        if (m, seed) in done and (seed != a.seeds[0] or m not in REPORTED or (directory / "models" / m).is_dir()):
            runs.append(done[(m, seed)])
            continue
        record, model = one_run(m, seed, a)
        record["settings"] = settings
        runs.append(record)
        if seed == a.seeds[0] and m in REPORTED:  # kept for the report (not part of the results)
            model.save_pretrained(directory / "models" / m)
        if seed == a.seeds[0]:
            save_projection(model, directory / "projections" / f"{m}.npy")
        # written after every run, so an interrupted study loses at most the run in progress
        save_runs(directory / "runs.json", runs, done)
        f = record["final"]
        print(
            f"[{i}/{len(plan)}] {m}, seed {seed}: ppl {f.get('eval_aniso/eval/ppl', math.nan):.2f}, "
            f"I(W) {f.get('aniso/geometry/head/isotropy', math.nan):.3f} ({record['wall_s']:.0f} s; "
            f"{time.perf_counter() - started:.0f} s so far)",
            flush=True,
        )
    save_runs(directory / "runs.json", runs, done)
    total = sum(r["wall_s"] for r in runs)
    header = f"{len(methods)} methods x seeds {a.seeds}, {a.steps} steps, V={a.vocab_size}, d={a.d_model}; {total:.0f} s of training"
    buckets = summary_table(runs, BUCKET_COLUMNS) if all("bucket/2500-4096" in r["final"] for r in runs) else ""
    (directory / "study.md").write_text(f"# Study: {header}\n\n{summary_table(runs, COLUMNS)}\n\n"
                                        f"Validation loss (nats) per frequency-rank bucket of the targets:\n\n{buckets}\n")
    written = [str(directory / "runs.json"), str(directory / "study.md"), *plots(runs, directory)]
    written += projection_grid([m for m in methods if (directory / "projections" / f"{m}.npy").exists()], directory)
    reported = [m for m in REPORTED if m in methods]
    if reported:  # MLE next to AGG through the offline report, rows coloured by the corpus's frequency groups
        written += report_plots([directory / "models" / m for m in reported], reported, a, directory)
    print("\n".join(written))
    return written


def report_plots(paths: list[Path], names: list[str], a: argparse.Namespace, directory: Path) -> list[str]:
    """spectrum.png, cosines.png, projection.png, layers.png, norm_frequency.png and report.md of
    the saved heads, with the whole corpus as the text (its counts give the frequency groups)."""
    from corpus import WordTokenizer, load_text, tokenize

    from aniso_plugins.offline.report import TextOptions, analyze

    text = load_text(a.text_file)
    ids, vocab = tokenize(text, a.vocab_size)
    options = TextOptions(text=text, tokenizer=WordTokenizer(vocab), max_tokens=len(ids))
    report = analyze([str(p) for p in paths], options, names=names, progress=False)
    report_dir = directory / "report"
    return report.write(report_dir)


if __name__ == "__main__":
    main()
