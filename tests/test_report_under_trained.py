"""The report's under-trained token finder on a checkpoint with planted under-trained rows:
rows beyond the tokenizer (padding, the known-unused reference) and three in-vocabulary tokens
left where those rows are; the real CLI in a subprocess, the scores against numpy."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("matplotlib")

from test_report import PNG, _text, _tokenizer  # noqa: E402
from test_under_trained import ref_scores  # noqa: E402

PLANTED = [17, 101, 202]
PADDING = 24


def _planted_checkpoint(folder, tok, planted: list[int]) -> np.ndarray:
    """A tiny GPT-2 whose rows beyond the tokenizer (padding: never a token, never trained) and
    the `planted` in-vocabulary rows sit near one initialization, saved with `tok` into `folder`;
    returns its (V, d) float64 embedding."""
    v = len(tok) + PADDING
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=v, n_embd=32, n_layer=1, n_head=2, n_positions=64, bos_token_id=0, eos_token_id=0))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        w = model.transformer.wte.weight
        w.copy_(torch.randn(v, 32, generator=g))
        init = torch.randn(32, generator=g)
        for rows in (list(range(len(tok), v)), planted):
            w[rows] = init + 0.02 * torch.randn(len(rows), 32, generator=g)
        w.add_(torch.randn(v, 1, generator=g) * 3)  # a direction every row shares
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return model.transformer.wte.weight.detach().double().numpy()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("under_trained")
    text = _text()
    tok = _tokenizer(text)
    w = _planted_checkpoint(root / "gpt2", tok, PLANTED)
    (root / "text.txt").write_text(text[:20_000], encoding="utf-8")
    return root, w, len(tok)


def test_report_lists_the_planted_tokens_first_and_verifies_them(checkpoint, tmp_path):
    root, w, n_tok = checkpoint
    out = tmp_path / "r"
    p = subprocess.run([sys.executable, "-m", "aniso_plugins.offline.cli", "report", str(root / "gpt2"), "--text-file",
                        str(root / "text.txt"), "--max-tokens", "1500", "--out", str(out), "--quiet"],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    u = json.loads((out / "report.json").read_text())["models"][0]["under_trained"]
    reference = np.arange(len(w)) >= n_tok
    assert u["reference"] == {"size": PADDING, "from": {"beyond_tokenizer": PADDING, "unused_or_reserved_name": 0,
                                                        "absent_from_counts_text": 0}}
    score = ref_scores(w, reference)
    assert u["suspected"] == int((score[~reference] >= 0.5).sum()) == len(PLANTED)
    top = u["candidates"][: len(PLANTED)]
    assert sorted(c["id"] for c in top) == PLANTED
    for c in u["candidates"]:
        assert c["score"] == pytest.approx(score[c["id"]], abs=1e-6)
        assert 0.0 <= c["repeat_probability"] <= 1.0 and c["verified"] == (c["repeat_probability"] < 0.01)
    assert [c["score"] for c in u["candidates"]] == sorted((c["score"] for c in u["candidates"]), reverse=True)
    assert top[0]["token"] is not None and top[0]["category"] in ("normal", "special")
    md = (out / "report.md").read_text()
    assert "## Under-trained tokens" in md and f"| {top[0]['id']} |" in md
    assert (out / "under_trained.png").read_bytes().startswith(PNG)


def test_without_reference_tokens_candidates_rank_by_the_lowest_input_norm(checkpoint):
    from aniso_plugins.offline.sources import load_model
    from aniso_plugins.offline.under_trained import find_under_trained

    root, w, n_tok = checkpoint
    loaded = load_model(root / "gpt2")
    loaded.tokenizer = None  # no tokenizer: nothing is known to be unused
    assert find_under_trained(loaded)["candidates"][0]["category"] == "unknown"
    u = find_under_trained(loaded)
    assert u["reference"]["size"] == 0 and u["suspected"] is None and "norm" in u["indicator"]
    norms = np.linalg.norm(w, axis=1)
    assert [c["id"] for c in u["candidates"][:5]] == np.argsort(norms)[:5].tolist()


def test_a_sampled_principal_direction_still_finds_the_planted_rows(checkpoint):
    """Above the report's Gram budget c₁ comes from a uniform row sample (here 200 of 324 rows)."""
    from aniso_plugins.offline.sources import MatrixSource
    from aniso_plugins.offline.under_trained import _gram_sample, _streamed_scores

    root, w, n_tok = checkpoint
    reference = torch.arange(len(w)) >= n_tok
    budget = 2.0 * 200 * 32 * 32
    assert int(_gram_sample(len(w), 32, budget).sum()) == 200 and _gram_sample(len(w), 32, 1e12) is None
    score = _streamed_scores(MatrixSource.of_tensor("embedding", torch.from_numpy(w)), reference, gram_flops=budget)
    top = torch.argsort(torch.where(reference, torch.tensor(-2.0, dtype=torch.float64), score), descending=True)[:3]
    assert sorted(top.tolist()) == PLANTED


def test_a_tokenizer_the_finder_cannot_read_leaves_the_rest_of_the_report(checkpoint, monkeypatch):
    from aniso_plugins.offline import report as report_mod
    from aniso_plugins.offline import under_trained

    def broken(*a, **k):
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "a broken vocabulary file")

    monkeypatch.setattr(under_trained, "_token_strings", broken)
    root, w, _ = checkpoint
    rep = report_mod.analyze([str(root / "gpt2")], progress=False)
    assert "a broken vocabulary file" in rep.models[0]["under_trained"]["error"]
    assert rep.models[0]["matrices"]["embedding"]["raw"]["mean_cosine"] is not None
    assert "Not computed: UnicodeDecodeError" in rep.to_markdown()


ODD_TOKENS = ["a,b", 'say "hi"', "two\nlines"]
"""Token strings a CSV must quote: a comma, double quotes, a newline."""


def test_every_suspected_token_is_in_under_trained_csv_most_suspect_first(checkpoint, tmp_path):
    """80 planted rows (more than the 50 listed in report.json), three of them tokens with a
    comma, quotes and a newline; two models in one report: one file with a ``model`` column."""
    import csv

    from aniso_plugins.offline import cli
    from aniso_plugins.offline.under_trained import CANDIDATES

    root, _, _ = checkpoint
    tok = _tokenizer(_text())
    tok.add_tokens(ODD_TOKENS)
    odd = tok.convert_tokens_to_ids(ODD_TOKENS)
    w = _planted_checkpoint(tmp_path / "m", tok, list(range(40, 117)) + odd)
    reference = np.arange(len(w)) >= len(tok)
    score = ref_scores(w, reference)
    expected = {int(i) for i in np.nonzero((score >= 0.5) & ~reference)[0]}  # numpy, independent of the package
    assert len(expected) >= 80 > CANDIDATES and set(odd) <= expected
    out = tmp_path / "r"
    args = ["report", str(tmp_path / "m"), str(tmp_path / "m"), "--text-file", str(root / "text.txt"), "--max-tokens", "300",
            "--out", str(out), "--quiet", "--no-plots"]
    assert cli.main(args) == 0
    with (out / "under_trained.csv").open(newline="", encoding="utf-8") as f:
        header, *rows = list(csv.reader(f))
    assert header == ["model", "id", "token", "category", "score", "norm", "repeat_probability", "verified"]
    report = json.loads((out / "report.json").read_text())
    md = (out / "report.md").read_text()
    for m in report["models"]:
        u = m["under_trained"]
        mine = [r for r in rows if r[0] == m["name"]]
        ids = [int(r[1]) for r in mine]
        assert len(ids) == len(set(ids)) == u["suspected"] == len(expected) and set(ids) == expected
        scores = [float(r[4]) for r in mine]
        assert scores == sorted(scores, reverse=True)
        np.testing.assert_allclose(scores, score[ids], atol=1e-6)
        assert [r[2] for r in mine] == [tok.convert_ids_to_tokens(i) for i in ids]  # quoting round-trips
        assert u["csv"] == "under_trained.csv" and len(u["candidates"]) == CANDIDATES
        assert [c["id"] for c in u["candidates"]] == ids[:CANDIDATES]
        assert [float(r[6]) for r in mine[:CANDIDATES]] == pytest.approx([c["repeat_probability"] for c in u["candidates"]])
        assert all(r[6] == r[7] == "" for r in mine[CANDIDATES:])  # the repeat test runs on the listed ones
    assert [m["name"] for m in report["models"]] == ["m", "m (2)"] and len(rows) == 2 * len(expected)
    assert {r[2] for r in rows} >= set(ODD_TOKENS)
    assert "[under_trained.csv](under_trained.csv)" in md and f"{len(expected):,}" in md
    assert cli.main(args) == 0  # a report folder with its csv is replaced as a whole
    assert sorted(p.name for p in out.iterdir()) == ["report.json", "report.md", "under_trained.csv"]
