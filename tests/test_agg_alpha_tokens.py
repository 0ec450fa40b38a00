"""AGG's rarity per ``alpha_tokens`` target tokens: the same rare group at every batch size
(gradient accumulation, a larger per-device batch, 2 DDP ranks), the official per-update group
when the tokens per update equal alpha_tokens, and the rare fractions logged. References are
written out here with numpy from the batch's targets."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from transformers import Trainer, TrainingArguments

from aniso_plugins import AnisoConfig
from aniso_plugins.integrations.hf import AnisoCallback
from aniso_plugins.methods.agg.counter import SlidingTokenCounter
from dist_utils import run_distributed
from hf_utils import VOCAB, TokenDataset, tiny_gpt2

ALPHA = 3.0  # per update: a token seen 1 or 2 times in a step is rare, at twice the batch it is not


def causal_targets(ids: torch.Tensor) -> np.ndarray:
    """The targets of a causal LM's step: every position but the first of each row."""
    return ids[:, 1:].reshape(-1).numpy()


def test_appearance_per_tokens_is_tokens_times_the_relative_count():
    g = torch.Generator().manual_seed(0)
    counter = SlidingTokenCounter(50, window=3, always_frequent=(0,))
    steps = [torch.randint(0, 50, (n,), generator=g) for n in (40, 70, 50)]
    for targets in steps:
        counter.update(targets)
        counter.step()
    counts = np.bincount(np.concatenate([t.numpy() for t in steps[1:]]), minlength=50)  # window 3: the last 2 + the current (empty)
    expected = (1000 * counts / counts.sum()).astype(np.float32)
    expected[0] = 1.0
    np.testing.assert_allclose(counter.appearance_per_tokens(1000).numpy(), expected, rtol=1e-6)
    per_step = counts.sum() / counter.steps_in_window
    assert per_step == 40  # 120 tokens over min(t, K) = 3 steps: alpha_tokens = 40 is the per-update appearance itself
    assert torch.equal(counter.appearance_per_tokens(int(per_step)), counter.appearance())


def rare_after_one_step(tmp_path, data, alpha_tokens, **args):
    """AGG's rare group after one optimizer step of a real Trainer on all of `data`, and its log."""
    config = AnisoConfig(method="agg", alpha=ALPHA, alpha_tokens=alpha_tokens, window=4, metrics=(),
                         load_entry_points=False)  # fmt: skip
    callback = AnisoCallback(config)
    kw = dict(report_to="none", use_cpu=True, disable_tqdm=True, save_strategy="no", seed=0, data_seed=0,
              max_steps=1, logging_steps=1, output_dir=str(tmp_path), **args)  # fmt: skip
    trainer = Trainer(model=tiny_gpt2(), args=TrainingArguments(**kw), train_dataset=data, callbacks=[callback])
    trainer.train()
    return callback.session.plugins.get("agg").last_gates.rare.numpy(), trainer.state.log_history[0]


class Doubled(torch.utils.data.Dataset):
    """Every example of `base` twice: a step over all of it counts every target twice."""

    def __init__(self, base):
        self.base = base

    def __len__(self):
        return 2 * len(self.base)

    def __getitem__(self, i):
        return self.base[i % len(self.base)]


def test_the_rare_group_is_the_same_at_twice_the_batch_and_is_the_official_one_at_alpha_tokens(tmp_path):
    base = TokenDataset(n=8, length=8)
    counts = np.bincount(causal_targets(base.ids), minlength=VOCAB)
    tokens = int(counts.sum())  # 56 target tokens per update in the base run
    official = counts < ALPHA  # a_k = c_k / 1 at step 1
    assert official.any() and (counts[official] > 0).any()
    runs = {
        "base": rare_after_one_step(tmp_path / "a", base, tokens, per_device_train_batch_size=8),
        "per_device_batch_x2": rare_after_one_step(tmp_path / "b", Doubled(base), tokens, per_device_train_batch_size=16),
        "accumulation_x2": rare_after_one_step(tmp_path / "c", Doubled(base), tokens, per_device_train_batch_size=8,
                                               gradient_accumulation_steps=2),  # fmt: skip
    }
    for name, (rare, _) in runs.items():
        np.testing.assert_array_equal(rare, official, err_msg=name)
    # the paper's per-update rarity changes with the batch: at twice the batch fewer ids are rare
    per_update, _ = rare_after_one_step(tmp_path / "d", Doubled(base), None, per_device_train_batch_size=16)
    np.testing.assert_array_equal(per_update, 2 * counts < ALPHA)
    assert per_update.sum() < official.sum()


def test_the_rare_fractions_are_logged_and_told_once(tmp_path, caplog):
    base = TokenDataset(n=8, length=8)
    counts = np.bincount(causal_targets(base.ids), minlength=VOCAB)
    with caplog.at_level(logging.INFO, logger="aniso_plugins"):
        rare, record = rare_after_one_step(tmp_path, base, None, per_device_train_batch_size=8)
    assert record["aniso/agg/rare_vocab_fraction"] == pytest.approx(rare.sum() / VOCAB)
    assert record["aniso/agg/rare_target_fraction"] == pytest.approx(counts[rare].sum() / counts.sum())
    told = [r.getMessage() for r in caplog.records if "are rare" in r.getMessage()]
    assert len(told) == 1 and f"{int(rare.sum())} of {VOCAB} ids" in told[0], told


def _two_ranks(rank, world, targets, tokens):
    counter = SlidingTokenCounter(VOCAB, window=4)
    counter.update(targets, all_reduce=True)  # each rank holds the whole base batch: the global step is twice it
    return counter.appearance_per_tokens(tokens).numpy(), counter.appearance().numpy()


@pytest.mark.slow
def test_two_ddp_ranks_give_the_rare_group_of_one_rank():
    base = TokenDataset(n=8, length=8).ids[:, 1:].reshape(-1)
    tokens = int(base.numel())
    one = SlidingTokenCounter(VOCAB, window=4)
    one.update(base)
    results = run_distributed(_two_ranks, base, tokens)
    for per_tokens, per_update in results:
        np.testing.assert_array_equal(per_tokens < ALPHA, one.appearance().numpy() < ALPHA)
        np.testing.assert_array_equal(per_update, 2 * one.appearance().numpy())  # the per-update appearance doubles
