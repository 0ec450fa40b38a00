"""The under-trained token metric (aniso_plugins/metrics/under_trained): the indicator against a
numpy float64 implementation of its formula, a planted case, the configuration's errors, and
the metric through a real transformers.Trainer (the reference = ids never seen as targets)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from transformers import Trainer, TrainingArguments

from aniso_plugins import AnisoConfig, ConfigError, SetupError
from aniso_plugins.integrations.hf import AnisoCallback
from aniso_plugins.metrics.under_trained.indicator import under_trained_scores
from hf_utils import VOCAB, TokenDataset, tiny_gpt2


def ref_scores(u: np.ndarray, reference: np.ndarray) -> np.ndarray:
    """cos(P u_i, P mean_R u) with P removing the first principal component (numpy SVD of the
    centred matrix, float64)."""
    u = u.astype(np.float64)
    c1 = np.linalg.svd(u - u.mean(0), full_matrices=False)[2][0]
    p = np.eye(u.shape[1]) - np.outer(c1, c1)
    x, r = u @ p, p @ u[reference].mean(0)
    return (x @ r) / (np.linalg.norm(x, axis=1) * np.linalg.norm(r))


def test_scores_equal_the_numpy_formula():
    g = torch.Generator().manual_seed(0)
    u = torch.randn(300, 12, generator=g, dtype=torch.float64) @ torch.diag(torch.linspace(3, 0.3, 12, dtype=torch.float64))
    reference = torch.zeros(300, dtype=torch.bool)
    reference[torch.randperm(300, generator=g)[:40]] = True
    got = under_trained_scores(u.float(), reference)
    np.testing.assert_allclose(got.numpy(), ref_scores(u.float().numpy(), reference.numpy()), rtol=1e-5, atol=1e-6)


def test_planted_under_trained_rows_are_found():
    """Unused rows near their initialization u₀, a shared drift along one direction for every
    row; five 'seen' tokens left near u₀ too are the suspects, the trained rows are not."""
    g = torch.Generator().manual_seed(1)
    v, d = 400, 64
    init = torch.randn(d, generator=g, dtype=torch.float64)
    trained = torch.randn(v, d, generator=g, dtype=torch.float64) * 2
    rows = trained.clone()
    unused, planted = torch.arange(350, 400), torch.arange(100, 105)
    rows[unused] = init + 0.05 * torch.randn(50, d, generator=g, dtype=torch.float64)
    rows[planted] = init + 0.05 * torch.randn(5, d, generator=g, dtype=torch.float64)
    rows += torch.randn(v, 1, generator=g, dtype=torch.float64) * torch.ones(d, dtype=torch.float64) * 4  # shared drift
    reference = torch.zeros(v, dtype=torch.bool)
    reference[unused] = True
    score = under_trained_scores(rows, reference)
    suspects = torch.nonzero((score >= 0.5) & ~reference).squeeze(1)
    assert suspects.tolist() == planted.tolist()
    assert score[reference].min() > 0.9


def test_configuration_errors_name_the_value():
    with pytest.raises(ConfigError, match=r"under_trained_threshold=1.5: expected a cosine in \(-1, 1\]"):
        AnisoConfig(under_trained_threshold=1.5)
    with pytest.raises(ConfigError, match=r"ids must be >= 0, got \[-2\]"):
        AnisoConfig(under_trained_reference_ids=(3, -2))
    args = TrainingArguments(output_dir="unused", report_to="none", use_cpu=True, max_steps=1)
    cb = AnisoCallback(AnisoConfig(metrics=["under_trained"], under_trained_reference_ids=[VOCAB], load_entry_points=False))
    model = tiny_gpt2()
    w0 = model.lm_head.weight.detach().clone()
    with pytest.raises(SetupError, match=f"ids must be < the vocabulary size {VOCAB}"):
        Trainer(model=model, args=args, train_dataset=TokenDataset(), callbacks=[cb])
    assert torch.equal(model.lm_head.weight, w0)


def test_metric_in_a_real_trainer_uses_the_ids_never_seen_as_targets(tmp_path):
    data = TokenDataset(n=16, length=8)
    seen = torch.zeros(VOCAB, dtype=torch.bool)
    seen[data.ids[:, 1:].reshape(-1)] = True  # the targets: the model shifts the labels
    assert 0 < int((~seen).sum()) < VOCAB
    args = TrainingArguments(
        output_dir=str(tmp_path), report_to="none", use_cpu=True, disable_tqdm=True, save_strategy="no",
        per_device_train_batch_size=16, max_steps=2, logging_steps=2, learning_rate=1e-2, seed=0,
    )
    cb = AnisoCallback(AnisoConfig(metrics=["under_trained"], load_entry_points=False))
    trainer = Trainer(model=tiny_gpt2(), args=args, train_dataset=data, callbacks=[cb])
    trainer.train()
    row = [r for r in trainer.state.log_history if "aniso/under_trained/suspected" in r][-1]
    assert row["aniso/under_trained/reference"] == int((~seen).sum())
    w = trainer.model.lm_head.weight.detach().double().numpy()
    score = ref_scores(w, (~seen).numpy())
    assert row["aniso/under_trained/suspected"] == int((score[seen.numpy()] >= 0.5).sum())
    assert row["aniso/under_trained/mean_score"] == pytest.approx(float(score[seen.numpy()].mean()), rel=1e-5, abs=1e-7)
    assert row["aniso/under_trained/reference_mean_score"] == pytest.approx(float(score[~seen.numpy()].mean()), rel=1e-5)


def test_no_reference_token_gives_nan_scores():
    from aniso_plugins.metrics.under_trained.indicator import finish

    zero = torch.tensor(0.0, dtype=torch.float64)
    out = finish({"suspected": zero, "reference_count": zero, "outside_count": torch.tensor(64.0),
                  "outside_score_sum": zero, "reference_score_sum": zero})
    assert out["reference"] == 0 and math.isnan(out["suspected"]) and math.isnan(out["mean_score"])


def test_the_mle_against_agg_script_runs(tmp_path, run_example):
    out = tmp_path / "ut"
    run_example("under_trained.py", "--steps", "6", "--seeds", "0", "--vocab-size", "512", "--block", "32",
                "--batch-size", "8", "--output-dir", str(out))
    import json

    runs = json.loads((out / "runs.json").read_text())
    assert [(r["method"], r["seed"]) for r in runs] == [("mle", 0), ("agg", 0)]
    assert all(r["reference"] >= 0 for r in runs) and "| mle |" in (out / "under_trained.md").read_text()
