"""The report as Markdown tables (`render_markdown`) and PNG plots (`render_plots`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from aniso_plugins.metrics.frequency.groups import GROUPS, UNSEEN
from aniso_plugins.offline.errors import ReportError, install_hint

if TYPE_CHECKING:
    from aniso_plugins.offline.report import Report

PROJECTION_POINTS = 20000
"""Points drawn in the 2-D projection plot (all rows are projected; at most this many drawn)."""

PLOTS = {
    "spectrum.png": (
        "Singular values of each matrix, normalised (σ_i / σ_1, raw rows)",
        "x: the index i of a singular value, largest first; y: σ_i / σ_1 on a log scale. A curve that drops fast: "
        "few directions carry the rows (low effective rank, degenerate)."),
    "cosines.png": (
        "Pairwise cosines of sampled rows: raw, centred, after each post-processing",
        "x: cos(w_i, w_j) of two of the 2000 sampled rows; y: density. Mass right of 0 in the raw panel: the rows "
        "share a direction (a cone, anisotropy); centred near 0: only a common offset."),
    "projection.png": (
        "Rows projected on their top two singular directions",
        "x, y: each row's coordinates ⟨w, u_1⟩, ⟨w, u_2⟩ along the matrix's first and second right singular "
        "vectors; colours, with a text: the token's frequency group. Rare tokens in a region of their own: the "
        "drift that AGG counters."),
    "layers.png": (
        "Hidden-state anisotropy per block",
        "x: the transformer block (0: the first block's output); y: mean cosine between sampled token "
        "occurrences of the text. Near 0: isotropic; toward 1: every hidden state points the same way."),
    "norm_frequency.png": (
        "Row norm against the token's frequency in the text",
        "x: the token's count in the text + 1, log scale; y: its row norm ‖w_i‖. A trend: the norms encode "
        "frequency."),
    "under_trained.png": (
        "Under-trained token indicator: histogram per model",
        "x: the score (cosine to the mean of the known-unused rows, dashed line: the threshold, suspected at or "
        "above it) or, with no known-unused token, the input-norm z-score (no threshold); y: tokens per bin, "
        "log scale."),
}
"""File name -> (title, what its axes show): the title is drawn on the picture, both go under it in report.md."""


_ROWS = (
    ("shape", None, "rows × dimension, stored dtype"),
    ("gram", None, "exact, or the rows sampled for the Gram-based metrics"),
    ("mean cosine", ("raw", "mean_cosine"), "average cosine of two rows; near 0 is isotropic, toward 1 a narrow cone (degenerate)"),
    ("mean cosine (centred)", ("centered", "mean_cosine"), "the same after removing the mean row; stays high only if the cone is not just an offset"),
    ("I(W)", ("raw", "isotropy"), "partition-function isotropy in [0, 1]; 1 isotropic, near 0 degenerate (depends on the rows' scale)"),
    ("I(W) (centred)", ("centered", "isotropy"), "I(W) of the centred rows"),
    ("effective rank (centred, p∝σ)", ("centered", "effective_rank"), "dimensions in use, up to the dimension; low is degenerate"),
    ("effective rank (centred, p∝σ²)", ("centered", "effective_rank_sigma2"), "the same weighting variance (σ²): lower than p∝σ"),
    ("effective rank (raw, p∝σ)", ("raw", "effective_rank"), "of the raw rows (a common offset takes one dimension)"),
    ("spectral saturation (raw)", ("raw", "singular_entropy"), "ln k − H(σ/Σσ): 0 for a flat spectrum, larger is more saturated (degenerate)"),
    ("σ_max (raw)", ("raw", "sigma_max"), "largest singular value"),
    ("σ/σ_max at k/2 (raw)", ("raw", "sv_normalized_q50"), "the median singular value relative to the largest; near 0 is a spectrum that collapses"),
    ("top-1 variance share (centred)", ("centered", "variance_share_top1"), "variance along the first principal direction; high is degenerate"),
    ("top-3 variance share (centred)", ("centered", "variance_share_top3"), "along the first three"),
    ("IsoScore", ("isoscore",), "uniformity of the variance over the dimensions in [0, 1]; 1 isotropic (scale-free)"),
    ("mean row norm", ("norm_mean",), "average ‖w_i‖"),
    ("non-finite entries", ("nonfinite",), "NaN or inf entries; anything but 0 makes the other numbers NaN"),
)

_EVAL_LABELS = (
    ("ppl", "perplexity (lower is better)"),
    *[(f"ppl_{g}", f"perplexity of {g} targets") for g in GROUPS],
    ("uniq", "Uniq: distinct predicted tokens (higher is more diverse)"),
    *[(f"uniq_{g}", f"Uniq among {g} tokens" + (" (near 0: rare tokens are never predicted)" if g == "rare" else ""))
      for g in GROUPS],
)
_BOTTLENECK_LABELS = (
    ("lost_fraction", "bottleneck: share of the logit gradient the head cannot pass on (higher loses more)"),
    ("kept_cosine", "bottleneck: cosine of the passed-on and the full logit gradient (1 loses nothing)"),
    ("tokens", "bottleneck: tokens probed"),
)

_SCALE_NOTE = (
    "I(W) is not scale-invariant: it reads exp⟨w_i, a⟩, so rows made longer by a transform (mean row norm "
    "after it: {norms}) lower it even when the directions become more uniform; compare IsoScore, the effective "
    "rank and the cosines across transforms."
)

_ROUND_OFF = 1e-12
"""Geometry values this close to 0 are floating-point round-off of 0 and shown as 0."""


def _fmt(x: Any) -> str:
    """A table cell: thousands separators for ints, 4 significant digits (or e-notation) for floats."""
    if x is None:
        return "–"
    if isinstance(x, bool):
        return str(x)
    if isinstance(x, int):
        return f"{x:,}"
    if isinstance(x, float):
        if not math.isfinite(x):
            return "nan" if math.isnan(x) else str(x)
        if x == 0:
            return "0"
        a = abs(x)
        return f"{x:.3e}" if a < 1e-3 or a >= 1e5 else f"{x:.4g}"
    return str(x)


def _get(d: dict, path: tuple[str, ...]) -> Any:
    """``d[p0][p1]…``, None where a key is missing."""
    for p in path:
        if not isinstance(d, dict) or p not in d:
            return None
        d = d[p]
    return d


def _columns(report: Report) -> list[tuple[str, dict]]:
    """(``model · matrix``, geometry) of every matrix of every model, in order."""
    return [(f"{m['name']} · {k}", g) for m in report.models for k, g in m["matrices"].items()]


def _table(header: Sequence[str], rows: Sequence[Sequence[str]], text_last: bool = False) -> str:
    """A Markdown table, first column left-aligned, the others right-aligned (the last one
    left-aligned too with `text_last`, for a column of words)."""
    align = ["---"] + ["---:"] * (len(header) - 1 - text_last) + ["---"] * text_last
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(align) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def _geometry_cell(x: Any) -> str:
    return "0" if isinstance(x, float) and abs(x) < _ROUND_OFF else _fmt(x)


def _geometry_table(columns: list[tuple[str, dict]]) -> str:
    """The `_ROWS` of every column, and what each measures."""
    rows = []
    for label, path, meaning in _ROWS:
        if label == "shape":
            cells = [f"{g.get('rows', '?')} × {g.get('dim', '?')} {g.get('dtype', '')}".strip() for _, g in columns]
        elif label == "gram":
            cells = [str(g.get("gram", "")) for _, g in columns]
        else:
            cells = [_geometry_cell(_get(g, path)) for _, g in columns]
        rows.append([label] + cells + [meaning])
    return _table(["metric"] + [c for c, _ in columns] + ["what it measures"], rows, text_last=True)


def _sentences_markdown(report: Report) -> list[str]:
    """The geometry of the pooled sentence embeddings, raw and after each post-processing, and
    a note for each model whose sentences were skipped."""
    skipped = [f"> **{m['name']}**: sentence embeddings skipped: {m['sentences']['skipped']}"
               for m in report.models if "skipped" in m.get("sentences", {})]
    with_s = [m for m in report.models if "geometry" in m.get("sentences", {})]
    if not with_s:
        return ["## Sentence embeddings", "", *skipped, ""] if skipped else []
    cols = [(f"{m['name']} · {m['sentences']['pooling']} pooling", m["sentences"]["geometry"]) for m in with_s]
    md = ["## Sentence embeddings", "", "The encoder's pooled vectors of the text's non-empty lines "
          f"({', '.join(str(m['sentences']['sentences']) for m in with_s)} sentences): the space that "
          "sentence-embedding post-processing (whitening, all-but-the-top) is for.", "", _geometry_table(cols), "",
          *([*skipped, ""] if skipped else [])]
    for pname in report.settings.get("postprocess") or []:
        post = [(c, g["postprocessed"][pname]) for c, g in cols if pname in g.get("postprocessed", {})]
        md += [f"### Sentence embeddings after {pname}", "", _geometry_table(post), ""]
    return md


def _under_trained_intro(u: dict) -> str:
    """The sentence above a model's table: the indicator, the reference tokens and the
    threshold, or why there is none (no known-unused token: the candidates ranked by norm)."""
    ref = u["reference"]
    if u.get("suspected") is None:
        return (f"Indicator: {u['indicator']}. No threshold, nothing suspected: the cosine indicator needs tokens "
                f"known unused beside the others ({ref['size']:,} known here; a tokenizer naming unused tokens, or "
                "--counts-file with the training text, tells). Score: how many standard deviations the token's "
                "input-embedding norm lies below the mean (higher = more suspect).")
    sources = ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in ref["from"].items() if v) or "none known"
    head = f"Indicator: {u['indicator']}. Reference tokens (known unused): {ref['size']:,} ({sources})."
    verified = "" if u.get("verified") is None else f"; verified by the repeat test among the listed: {u['verified']}"
    listing = f" All {u['suspected']:,} suspected, most suspect first: [{u['csv']}]({u['csv']})." if u.get("csv") else ""
    return f"{head} Suspected (score ≥ {u['threshold']}): {u['suspected']:,}{verified}.{listing}"


def _under_trained_table(u: dict) -> str:
    """The 20 most suspect tokens; the score column names the threshold (or that there is
    none), the token column is left out without a tokenizer (the id names the token)."""
    candidates = u["candidates"][:20]
    named = any(c["token"] is not None for c in candidates)
    verified = any("repeat_probability" in c for c in candidates)
    score = f"score (suspected ≥ {u['threshold']})" if u.get("suspected") is not None else "norm z-score (no threshold)"
    header = ["id", *(["token"] if named else []), "category", score, "input norm", *(["p(repeat)"] if verified else [])]
    rows = [[str(c["id"]), *([_token_cell(c["token"])] if named else []), c["category"], _fmt(c["score"]),
             _fmt(c["norm"]), *([_fmt(c.get("repeat_probability"))] if verified else [])] for c in candidates]
    return _table(header, rows)


def _token_cell(token: str | None) -> str:
    return "–" if token is None else f"`{token}`".replace("|", "\\|")


def _under_trained_markdown(report: Report) -> list[str]:
    """One table per model of its most suspect under-trained tokens (docs/report.md)."""
    md: list[str] = []
    for m in report.models:
        u = m.get("under_trained")
        if not u:
            continue
        if "error" in u:
            md += [f"### {m['name']}", "", f"Not computed: {u['error']}", ""]
            continue
        md += [f"### {m['name']}", "", _under_trained_intro(u), ""]
        if not any(c["token"] is not None for c in u["candidates"]):
            md += ["No tokenizer: each token is given by its id.", ""]
        md += [_under_trained_table(u), ""]
    return (["## Under-trained tokens", "", "Tokens whose rows look like those of tokens the model never trained on "
             "(Land & Bartolo 2024): higher score = more suspect; p(repeat) < 0.01 verifies one.", ""] + md) if md else []


def _plots_markdown(plots: Sequence[str]) -> list[str]:
    """Each written picture as an image link (relative to report.md), its title and what its
    axes show."""
    md = []
    for name in plots:
        title, axes = PLOTS.get(name, (name, ""))
        md += [f"### {title}", "", f"![{title}]({name})", "", axes, ""]
    return ["## Plots", "", *md] if md else []


def render_markdown(report: Report, plots: Sequence[str] = ()) -> str:
    """The report's tables as Markdown, and the pictures `plots` (file names beside report.md)."""
    md = ["# Embedding geometry report", ""]
    md.append(", ".join(f"**{m['name']}** ({m['kind']}{', tied' if m.get('tied') else ''}): `{m['path']}`" for m in report.models))
    notes = [f"> **{m['name']}**: {note}" for m in report.models for note in m.get("notes", [])]
    md += ["", *notes, *([""] if notes else []), "## Geometry", "", _geometry_table(_columns(report)), ""]
    for pname in report.settings.get("postprocess") or []:
        cols = [(c, g["postprocessed"][pname]) for c, g in _columns(report) if pname in g.get("postprocessed", {})]
        md += [f"## After {pname}", "", _geometry_table(cols), "", _SCALE_NOTE.format(
            norms=", ".join(f"{c} {_fmt(g.get('norm_mean'))}" for c, g in cols)), ""]
    with_text = [m for m in report.models if "text" in m]
    if with_text:
        md += ["## Text", ""]
        rows = [
            ["tokens"] + [_fmt(m["text"]["tokens"]) for m in with_text],
            ["sequences × length"] + [f"{m['text']['sequences']} × {m['text']['sequence_length']}" for m in with_text],
            ["distinct tokens (share of the vocabulary)"] + [
                f"{m['text']['distinct_tokens']:,} ({m['text']['coverage']:.1%})" for m in with_text],
        ]
        for g in GROUPS:
            rows.append([f"{g}: ids / share of tokens"] + [
                f"{m['text']['group_sizes'][g]:,} / {m['text']['group_token_share'][g]:.3f}" for m in with_text])
        for key, label in _EVAL_LABELS:
            if any(key in m["text"].get("eval", {}) for m in with_text):
                rows.append([label] + [_fmt(m["text"].get("eval", {}).get(key)) for m in with_text])
        for g in GROUPS:
            for key in ("isotropy", "mean_cosine"):
                rows.append([f"{g} rows: {'I(W)' if key == 'isotropy' else 'mean cosine'}"] + [
                    _fmt(m["text"]["frequency"].get(f"{g}/{key}")) for m in with_text])
        rows.append(["rare–frequent mean cosine"] + [_fmt(m["text"]["frequency"].get("rare_frequent_cosine")) for m in with_text])
        for key, label in _BOTTLENECK_LABELS:
            if any(key in m["text"].get("bottleneck", {}) for m in with_text):
                rows.append([label] + [_fmt(m["text"].get("bottleneck", {}).get(key)) for m in with_text])
        md += [_table(["text metric"] + [m["name"] for m in with_text], rows), ""]
        md += [f"> **{m['name']}**: {m['text']['warning']}" for m in with_text if m["text"].get("warning")]
        n_layers = max(len(m["text"]["hidden_mean_cosine"]) for m in with_text)
        rows = [[str(i)] + [_fmt(m["text"]["hidden_mean_cosine"][i]) if i < len(m["text"]["hidden_mean_cosine"]) else "–"
                            for m in with_text] for i in range(n_layers)]
        md += ["### Hidden-state anisotropy (mean cosine of sampled token occurrences, per block)", "",
               _table(["block"] + [m["name"] for m in with_text], rows), ""]
    md += _sentences_markdown(report)
    md += _under_trained_markdown(report)
    md += _plots_markdown([Path(p).name for p in plots])
    return "\n".join(md) + "\n"


MATPLOTLIB_HINT = f"pip install matplotlib, or {install_hint('report')}"
"""How to get the plots."""


def has_matplotlib() -> bool:
    """Whether matplotlib imports."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def require_matplotlib():
    """The matplotlib module; `ReportError` without it (checked before any work)."""
    try:
        import matplotlib
    except ImportError:
        raise ReportError(f"plots need matplotlib ({MATPLOTLIB_HINT}); or write without them (--no-plots)") from None
    return matplotlib


def _pyplot():
    """matplotlib.pyplot on the Agg backend; `ReportError` without matplotlib."""
    matplotlib = require_matplotlib()
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


class _Figures:
    """Saves figures into one directory and remembers the paths."""

    def __init__(self, plt, directory: Path) -> None:
        self.plt, self.directory, self.written = plt, directory, []

    def save(self, fig, name: str) -> None:
        path = self.directory / name
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        self.plt.close(fig)
        self.written.append(str(path))


def _plot_spectrum(plt, cols: list[tuple[str, dict]]):
    """σ_i/σ_1 of every matrix (raw), log scale."""
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for label, g in cols:
        sv = [max(x, 1e-12) for x in g["spectrum"]]
        ax.plot(range(1, len(sv) + 1), sv, label=label)
    ax.set_yscale("log")
    ax.set_xlabel("index i of the singular value (largest first)")
    ax.set_ylabel("σ_i / σ_1 (log scale)")
    ax.set_title(PLOTS["spectrum.png"][0], fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return fig


def _plot_cosines(plt, cols: list[tuple[str, dict]], postprocess: Sequence[str]):
    """Densities of the pairwise cosines of sampled rows: raw, centred, after each post-processing."""
    panels = [("raw", "cosine_histogram", None), ("centred", "cosine_histogram_centered", None)]
    panels += [(p, "cosine_histogram", p) for p in postprocess if p != "centering"]  # "centred" already is it
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6), squeeze=False, sharex=True, sharey=True)
    for ax, (title, key, post) in zip(axes[0], panels):
        for label, g in cols:
            src = g if post is None else g.get("postprocessed", {}).get(post)
            if not src:
                continue
            h = src[key]
            n = len(h["counts"])
            edges = [h["min"] + (h["max"] - h["min"]) * i / n for i in range(n + 1)]
            total = max(1, sum(h["counts"]))
            width = (h["max"] - h["min"]) / n
            ax.stairs([c / total / width for c in h["counts"]], edges, label=label)
        ax.set_title(f"pairwise cosines: {title}")
        ax.set_xlabel("cos(w_i, w_j), sampled rows")
        ax.set_ylabel("density")
        ax.legend(fontsize=7)
    fig.suptitle(PLOTS["cosines.png"][0], fontsize=10)
    return fig


def _projection_panel(ax, m: dict, k: str, g: dict) -> None:
    """One matrix's rows on its top two singular directions, coloured by frequency group when
    the model has a text."""
    colors = {0: "tab:red", 1: "tab:orange", 2: "tab:blue", UNSEEN: "lightgrey"}
    xy = g["_projection"]
    gen = torch.Generator().manual_seed(0)
    pick = torch.randperm(len(xy), generator=gen)[:PROJECTION_POINTS]  # a random drawing order: no group hides another
    groups = m.get("text", {}).get("_groups")
    if groups is not None and len(groups) == len(xy):
        unseen, seen = pick[groups[pick] == UNSEEN], pick[groups[pick] != UNSEEN]
        ax.scatter(xy[unseen, 0], xy[unseen, 1], s=2, alpha=0.4, c=colors[UNSEEN], linewidths=0)
        ax.scatter(xy[seen, 0], xy[seen, 1], s=3, alpha=0.6, c=[colors[int(i)] for i in groups[seen]], linewidths=0)
        for gi, name in [*enumerate(GROUPS), (UNSEEN, "not in the text")]:  # legend entries only
            ax.scatter([], [], s=9, c=colors[gi], label=name)
        ax.legend(fontsize=7)
    else:
        ax.scatter(xy[pick, 0], xy[pick, 1], s=3, alpha=0.5, linewidths=0)
    ax.set_title(f"{m['name']} · {k}", fontsize=9)
    ax.set_xlabel("⟨w, u_1⟩: along the 1st singular direction")
    ax.set_ylabel("⟨w, u_2⟩: along the 2nd singular direction")


def _plot_projection(plt, items: list[tuple[dict, str, dict]]):
    """Panels of `_projection_panel`, at most three a row."""
    n = len(items)
    ncols = min(n, 3)
    nrows = math.ceil(n / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.2 * ncols, 4.0 * nrows), squeeze=False, sharex=True, sharey=True)
    for ax in axes.flat[n:]:
        ax.set_visible(False)
    for ax, (m, k, g) in zip(axes.flat, items):
        _projection_panel(ax, m, k, g)
    fig.suptitle(PLOTS["projection.png"][0], fontsize=10)
    return fig


def _plot_layers(plt, with_text: list[dict]):
    """Hidden-state anisotropy per block, one line per model."""
    fig, ax = plt.subplots(figsize=(6.0, 4.0))
    for m in with_text:
        y = m["text"]["hidden_mean_cosine"]
        ax.plot(range(len(y)), y, marker="o", label=m["name"])
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("block (0 = the first transformer block's output)")
    ax.set_ylabel("mean cosine of random token occurrences")
    ax.set_title(PLOTS["layers.png"][0], fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return fig


def _plot_norm_frequency(plt, with_text: list[dict]):
    """Row norm against the token's count in the text, one panel per matrix kind."""
    kinds = sorted({k for m in with_text for k, g in m["matrices"].items() if "_norms" in g})
    fig, axes = plt.subplots(1, len(kinds), figsize=(5.0 * len(kinds), 4.0), squeeze=False)
    for ax, k in zip(axes[0], kinds):
        for m in with_text:
            g = m["matrices"].get(k)
            counts = m["text"]["_counts"]
            if g is None or "_norms" not in g or len(g["_norms"]) != len(counts):
                continue
            gen = torch.Generator().manual_seed(0)
            pick = torch.randperm(len(counts), generator=gen)[:PROJECTION_POINTS]
            ax.scatter(counts[pick].double() + 1, g["_norms"][pick], s=3, alpha=0.4, label=m["name"], linewidths=0)
        ax.set_xscale("log")
        ax.set_xlabel("token count in the text + 1")
        ax.set_ylabel("row norm ‖w_i‖")
        ax.set_title(f"norm vs frequency: {k}")
        ax.legend(fontsize=7, markerscale=3)
    fig.suptitle(PLOTS["norm_frequency.png"][0], fontsize=10)
    return fig


def _plot_under_trained(plt, models: list[dict]):
    """Histogram of the under-trained indicator, reference tokens and the others, per model,
    with the threshold of the report's text and table (none for the norm ranking)."""
    fig, axes = plt.subplots(1, len(models), figsize=(5.0 * len(models), 3.8), squeeze=False, sharey=True)
    for ax, m in zip(axes[0], models):
        u = m["under_trained"]
        score, ref = u["_scores"].double(), u["_reference"]
        finite = torch.isfinite(score)
        lo, hi = (float(score[finite].min()), float(score[finite].max())) if finite.any() else (0.0, 1.0)
        bins = torch.linspace(lo, hi + 1e-9, 41).tolist()
        scored = u.get("suspected") is not None
        ax.hist(score[~ref & finite].tolist(), bins=bins, alpha=0.7, label="other tokens" if scored else "tokens", log=True)
        if scored:
            ax.hist(score[ref & finite].tolist(), bins=bins, alpha=0.7, label="known unused", log=True)
            ax.axvline(u["threshold"], color="k", lw=0.8, ls="--", label=f"threshold {u['threshold']} (suspected ≥)")
            ax.set_xlabel("score: cosine to the unused rows' mean")
        else:
            ax.set_xlabel("input-norm z-score (no known-unused token: no threshold)")
        ax.set_title(m["name"], fontsize=9)
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel("tokens per bin (log scale)")
    fig.suptitle(PLOTS["under_trained.png"][0], fontsize=10)
    return fig


def render_plots(report: Report, directory: Path) -> list[str]:
    """spectrum.png, cosines.png, projection.png, under_trained.png and, with a text,
    layers.png and norm_frequency.png; returns the paths written."""
    plt = _pyplot()
    directory.mkdir(parents=True, exist_ok=True)
    figures = _Figures(plt, directory)
    cols = _columns(report)
    figures.save(_plot_spectrum(plt, cols), "spectrum.png")
    figures.save(_plot_cosines(plt, cols, report.settings.get("postprocess") or []), "cosines.png")
    items = [(m, k, g) for m in report.models for k, g in m["matrices"].items() if "_projection" in g]
    if items:
        figures.save(_plot_projection(plt, items), "projection.png")
    with_text = [m for m in report.models if "text" in m]
    if with_text:
        figures.save(_plot_layers(plt, with_text), "layers.png")
        figures.save(_plot_norm_frequency(plt, with_text), "norm_frequency.png")
    with_under = [m for m in report.models if m.get("under_trained") and "error" not in m["under_trained"]]
    if with_under:
        figures.save(_plot_under_trained(plt, with_under), "under_trained.png")
    return figures.written


__all__ = [
    "MATPLOTLIB_HINT",
    "PLOTS",
    "PROJECTION_POINTS",
    "has_matplotlib",
    "render_markdown",
    "render_plots",
    "require_matplotlib",
]
