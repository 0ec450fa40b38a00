"""The report's under-trained token finder (docs/report.md "Under-trained tokens"): Land &
Bartolo 2024's unembedding indicator (`aniso_plugins.metrics.under_trained.indicator`, the same
formula as the live metric) over the streamed rows of a checkpoint, the decoded tokens, and for a
causal LM with its model loaded the repeat test that verifies each candidate.

Reference tokens R (known unused): rows beyond the tokenizer's vocabulary (padding rows), tokens
whose string names them unused or reserved ("[unused3]", "<|reserved_special_token_5|>"), and,
with a counts text (``--counts-file``, e.g. the training text), the ids it never contains. With
no reference the candidates are ranked by the input embedding's row norm instead (lowest first:
rows that no gradient reached keep their small initial norm, the indicator for encoders).

report.json lists the `CANDIDATES` most suspect tokens; every suspected one (score ≥ `THRESHOLD`)
goes to ``under_trained.csv`` in the report folder (`write_suspects_csv`).
"""

from __future__ import annotations

import csv
import math
import re
from pathlib import Path
from typing import Any

import torch

from aniso_plugins.metrics.geometry.stats import BLOCK_ROWS
from aniso_plugins.metrics.under_trained.indicator import directions, reference_stats, scores
from aniso_plugins.numerics.reduce import stat_values, sum_over_blocks
from aniso_plugins.offline.analysis import GRAM_FLOPS
from aniso_plugins.offline.output import UNDER_TRAINED_CSV
from aniso_plugins.offline.sources import LoadedModel, MatrixSource

THRESHOLD = 0.5
"""Suspected: score ≥ this (as ``under_trained_threshold`` of the live metric)."""
CANDIDATES = 50
"""Candidates listed per model, most suspect first."""
REPEAT_PROBABILITY = 0.01
"""Verified under-trained: the model gives the token less than this probability when asked to
repeat it (Land & Bartolo's verification threshold)."""
CSV_COLUMNS = ("model", "id", "token", "category", "score", "norm", "repeat_probability", "verified")
"""The columns of ``under_trained.csv``: one row per suspected token (`write_suspects_csv`)."""
_RESERVED = re.compile(r"unused|reserved", re.IGNORECASE)


def _token_strings(tokenizer: Any, vocab: int) -> list[str | None] | None:
    """The token string of every id (None beyond the tokenizer), or None without a tokenizer
    that can list its tokens (``len`` and ``convert_ids_to_tokens``, as transformers' have)."""
    if not (hasattr(tokenizer, "convert_ids_to_tokens") and hasattr(tokenizer, "__len__")):
        return None
    n = min(vocab, len(tokenizer))
    return [str(t) for t in tokenizer.convert_ids_to_tokens(list(range(n)))] + [None] * (vocab - n)


def reference_mask(strings: list[str | None] | None, vocab: int, counts: torch.Tensor | None) -> tuple[torch.Tensor, dict[str, int]]:
    """The (V,) mask of R and how many ids each source gave (a token may come from several);
    `strings` None: no tokenizer, only the counts can tell."""
    v = vocab
    strings = strings if strings is not None else []
    beyond = torch.tensor([s is None for s in strings], dtype=torch.bool) if strings else torch.zeros(v, dtype=torch.bool)
    named = torch.tensor([s is not None and bool(_RESERVED.search(s)) for s in strings], dtype=torch.bool) if strings \
        else torch.zeros(v, dtype=torch.bool)
    unseen = counts[:v] == 0 if counts is not None else torch.zeros(v, dtype=torch.bool)
    sources = {"beyond_tokenizer": int(beyond.sum()), "unused_or_reserved_name": int(named.sum()),
               "absent_from_counts_text": int(unseen.sum())}
    return beyond | named | unseen, sources


def _category(token: str | None, i: int, special: set[int], listed: bool) -> str:
    if token is None:
        return "beyond_tokenizer" if listed else "unknown"
    if i in special:
        return "special"
    if _RESERVED.search(token):
        return "unused_or_reserved_name"
    if "\ufffd" in token:
        return "partial_utf8"
    return "normal"


def _gram_sample(v: int, d: int, gram_flops: float) -> torch.Tensor | None:
    """None (every row) when the d×d Gram of V rows costs at most `gram_flops`, else the bool
    mask of a uniform sample of max(4d, gram_flops / 2d²) rows (seed 0), as the report's
    geometry does (docs/report.md)."""
    if 2.0 * v * d * d <= gram_flops:
        return None
    m = min(v, max(4 * d, int(gram_flops / (2.0 * d * d))))
    mask = torch.zeros(v, dtype=torch.bool)
    mask[torch.randperm(v, generator=torch.Generator().manual_seed(0))[:m]] = True
    return mask


def _streamed_scores(source: MatrixSource, reference: torch.Tensor, gram_flops: float = GRAM_FLOPS) -> torch.Tensor:
    """`scores` of every row, the two rounds streamed over row blocks (c₁ from a row sample
    above `gram_flops`)."""
    blocks = lambda: ((a, b.to(torch.float64)) for a, b in source.blocks(BLOCK_ROWS))  # noqa: E731
    sample = _gram_sample(*source.shape, gram_flops)
    reduced = stat_values(sum_over_blocks(
        reference_stats(b, reference[a : a + len(b)], gram_rows=None if sample is None else sample[a : a + len(b)])
        for a, b in blocks()))
    c1, r = directions(reduced)
    return torch.cat([scores(b, c1, r) for _, b in blocks()])


def _norms(source: MatrixSource) -> torch.Tensor:
    return torch.cat([b.to(torch.float64).norm(dim=1) for _, b in source.blocks(BLOCK_ROWS)])


def repeat_probabilities(loaded: LoadedModel, ids: list[int], batch: int = 32) -> list[float]:
    """p(token | "Repeat after me: «token». Again: ") of each of `ids`, the model's own next-token
    probability of repeating it (1 for a token it has learned to copy, ~0 for one it never saw)."""
    tok, model = loaded.tokenizer, loaded.model
    prefix = tok("Repeat after me:", add_special_tokens=False)["input_ids"]
    infix = tok(". Again:", add_special_tokens=False)["input_ids"]
    device = next(model.parameters()).device
    out: list[float] = []
    with torch.no_grad():
        for s in range(0, len(ids), batch):
            chunk = torch.tensor(ids[s : s + batch], device=device)
            seq = torch.cat([torch.tensor(prefix, device=device).expand(len(chunk), -1), chunk[:, None],
                             torch.tensor(infix, device=device).expand(len(chunk), -1)], dim=1)
            logits = model(input_ids=seq).logits[:, -1].float()
            out += torch.softmax(logits, -1).gather(1, chunk[:, None]).squeeze(1).tolist()
    return out


def _rows(ids: list[int], strings: list[str | None], score: torch.Tensor, norms: torch.Tensor, special: set[int],
          listed: bool) -> dict[int, dict[str, Any]]:
    """id -> ``{"id", "token", "category", "score", "norm"}`` of each of `ids`."""
    scores, norm = score.tolist(), norms.tolist()
    return {i: {"id": i, "token": strings[i], "category": _category(strings[i], i, special, listed),
                "score": float(scores[i]), "norm": float(norm[i]) if i < len(norm) else math.nan} for i in ids}


def find_under_trained(loaded: LoadedModel, counts: torch.Tensor | None = None,
                       norms: torch.Tensor | None = None) -> dict[str, Any]:
    """``models[i].under_trained`` of the report: the indicator used, R's size by source, the
    number suspected (score ≥ `THRESHOLD` outside R), counts by category and the `CANDIDATES`
    most suspect tokens outside R (``id``, ``token``, ``category``, ``score``, ``norm`` and,
    when verified, ``repeat_probability`` and ``verified``); ``_suspects``: the rows of every
    suspected token, most suspect first, and ``csv`` the file that lists them in the report
    folder (`write_suspects_csv`; None without a reference, when nothing can be suspected).
    `norms`: the input embedding's row norms when the caller has them (the report's geometry
    pass), else read here."""
    matrix = loaded.matrices.get("head") or loaded.matrices["embedding"]
    listed = _token_strings(loaded.tokenizer, matrix.shape[0])
    reference, sources = reference_mask(listed, matrix.shape[0], counts)
    strings = listed if listed is not None else [None] * matrix.shape[0]
    if norms is None:
        norms = _norms(loaded.matrices["embedding"] if "embedding" in loaded.matrices else matrix)
    norms = norms.to(torch.float64)
    outside = ~reference
    if reference.any() and outside.any():
        indicator, score = f"{matrix.name} cosine to the unused mean (first principal direction removed)", _streamed_scores(matrix, reference)
        suspected = int((score[outside] >= THRESHOLD).sum())
    else:
        indicator, suspected = "input-embedding row norm, lowest first (no reference tokens known)", None
        score = -(norms - norms[outside].mean()) / norms[outside].std().clamp_min(1e-12) if outside.sum() > 1 else -norms
    ranked = torch.argsort(score, descending=True)
    order = ranked[outside[ranked]].tolist()
    suspect_ids = [] if suspected is None else ranked[outside[ranked] & (score[ranked] >= THRESHOLD)].tolist()
    special = set(getattr(loaded.tokenizer, "all_special_ids", []) or [])
    rows = _rows(list(dict.fromkeys(order[:CANDIDATES] + suspect_ids)), strings, score, norms, special, listed is not None)
    candidates = [rows[i] for i in order[:CANDIDATES]]
    if loaded.kind == "causal-lm" and loaded.model is not None and listed is not None and candidates:
        for c, p in zip(candidates, repeat_probabilities(loaded, [c["id"] for c in candidates])):
            c["repeat_probability"], c["verified"] = p, p < REPEAT_PROBABILITY
    by_category: dict[str, int] = {}
    for c in candidates:
        by_category[c["category"]] = by_category.get(c["category"], 0) + 1
    return {
        "indicator": indicator, "threshold": None if suspected is None else THRESHOLD, "reference": {"size": int(reference.sum()), "from": sources},
        "suspected": suspected, "verified": sum(bool(c.get("verified")) for c in candidates) if candidates and "verified" in candidates[0] else None,
        "candidates_by_category": by_category, "candidates": candidates,
        "csv": None if suspected is None else UNDER_TRAINED_CSV, "_suspects": [rows[i] for i in suspect_ids],
        "_scores": score, "_reference": reference,
    }


def write_suspects_csv(models: list[dict[str, Any]], path: Path) -> bool:
    """Every suspected under-trained token of the report's `models` (their ``_suspects``) into
    the CSV file `path` (`CSV_COLUMNS`; the models in order, each most suspect first; the token
    empty where the tokenizer cannot name it, the repeat test's columns empty where it did not
    run). False, and no file, when no model has a reference to suspect against (its ``csv`` is None)."""
    suspects = [(m["name"], m["under_trained"]["_suspects"]) for m in models if (m.get("under_trained") or {}).get("csv")]
    if not suspects:
        return False
    with path.open("w", newline="", encoding="utf-8") as f:
        out = csv.writer(f)
        out.writerow(CSV_COLUMNS)
        for name, rows in suspects:
            out.writerows([name, r["id"], "" if r["token"] is None else r["token"], r["category"], r["score"], r["norm"],
                           r.get("repeat_probability", ""), r.get("verified", "")] for r in rows)
    return True


__all__ = [
    "CANDIDATES",
    "CSV_COLUMNS",
    "REPEAT_PROBABILITY",
    "THRESHOLD",
    "find_under_trained",
    "reference_mask",
    "repeat_probabilities",
    "write_suspects_csv",
]
