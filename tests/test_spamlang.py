"""SpamLang (examples/spamlang.py): the language as the seed defines it, and the quick sweep
through the real HF Trainer and the real script entry point, which writes every file."""

from __future__ import annotations

import json

import pytest
import torch
from spamlang import SpamLang, accuracy_and_loss


def test_every_sequence_is_bos_then_one_repeated_token():
    data = SpamLang(vocab=50, n=200, length=6, seed=3)
    ids = data.ids
    assert (ids[:, 0] == 0).all() and (ids[:, 1:] == ids[:, 1:2]).all()
    assert ids[:, 1].min() >= 1 and ids[:, 1].max() < 50  # the usable ids exclude BOS
    assert data.coverage() == pytest.approx(len(set(ids[:, 1].tolist())) / 49)
    no_bos = SpamLang(vocab=50, n=10, length=6, seed=3, bos=False)
    assert (no_bos.ids == no_bos.ids[:, :1]).all()
    with pytest.raises(ValueError, match="length=2"):
        SpamLang(vocab=50, n=1, length=2, seed=0)


def test_accuracy_counts_positions_from_two_on():
    class Copy(torch.nn.Module):  # predicts the previous token: right from position 2 on
        def forward(self, input_ids):
            logits = torch.nn.functional.one_hot(input_ids, 50).float()
            return type("Out", (), {"logits": logits})()

    data = SpamLang(vocab=50, n=8, length=5, seed=0)
    accuracy, loss = accuracy_and_loss(Copy(), data)
    assert accuracy == 1.0
    # cross-entropy of a one-hot logit vector: log(e + 49) − 1, by hand
    assert loss == pytest.approx(float(torch.log(torch.tensor(torch.e + 49.0)) - 1.0), rel=1e-6)


def test_quick_sweep_writes_every_file_and_the_probe_starts_near_one_minus_d_over_v(tmp_path, run_example):
    out = tmp_path / "spam"
    run_example("spamlang.py", "--quick", "--output-dir", str(out))
    results = json.loads((out / "spamlang.json").read_text())
    assert [(r["sweep"], r["vocab"], r["d"]) for r in results] == [
        ("vocab", 64, 8), ("vocab", 256, 8), ("d", 128, 4), ("d", 128, 8),
    ]
    for r in results:  # a random head at initialisation keeps ~D/V of the gradient (methods.md §9.2)
        assert abs(r["lost_fraction_start"] - (1 - r["d"] / r["vocab"])) < 0.06, r
        assert 0.0 <= r["accuracy"] <= 1.0 and 0.0 < r["coverage"] <= 1.0
    assert "| vocab | d | accuracy" in (out / "spamlang.md").read_text()
    from PIL import Image

    with Image.open(out / "spamlang.png") as image:
        assert image.size[0] > 100
