"""AGG says when it gates nothing or most of the target tokens (issue #43): once the token
counter's window is full, one `AGGGatingWarning` (also a WARNING on the ``aniso_plugins`` logger)
naming alpha, alpha_tokens, the window, the tokens seen, the share gated and the setting that
would gate about 5%; and the ``rare_fraction`` option (α chosen from the counter so that about
that share of the window's target tokens is rare, docs/methods.md §1.2). References are the
run's own targets counted here with numpy."""

from __future__ import annotations

import functools
import logging
import re
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import corpus
from aniso_plugins import AnisoConfig, AnisoPlugins, ConfigError, ModelHandle, RunInfo, StepInfo
from aniso_plugins.methods.agg.gates import rare_fraction_alpha
from aniso_plugins.methods.agg.plugin import AGGGatingWarning

V, LENGTH, BATCH, EPOCH = 512, 32, 8, 25  # the examples' corpus, 512 ids; 25 optimizer steps an epoch
README = dict(alpha=0.03, alpha_tokens=32768)  # the README's alpha, the guide's alpha_tokens
SPECIAL = 0  # <unk>: frequent in this corpus, never rare


@functools.cache
def sequences() -> torch.Tensor:
    """EPOCH·BATCH sequences of LENGTH + 1 tokens of Python's help text (no download)."""
    ids, _ = corpus.tokenize(corpus.load_text(), V)
    return ids[: EPOCH * BATCH * (LENGTH + 1)].view(EPOCH * BATCH, LENGTH + 1)


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(V, 8)
        self.lm_head = nn.Linear(8, V, bias=False)

    def forward(self, ids):
        return self.lm_head(torch.tanh(self.embed(ids)))


def run(steps: int, **options):
    """`steps` optimizer steps through the plugins as an adapter drives them (window: the epoch,
    as the trainers report it). Returns the plugin, its AGGGatingWarnings, each step's targets
    and each step's rare group."""
    config = AnisoConfig(method="agg", special_ids=(SPECIAL,), metrics=(), load_entry_points=False, **options)
    plugins = AnisoPlugins(config)
    torch.manual_seed(0)
    model = TinyLM()
    plugins.setup(ModelHandle(model, head="lm_head"))
    plugins.begin_training(RunInfo(epoch_steps=EPOCH))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    agg, targets, rare = plugins.get("agg"), [], []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for t in range(1, steps + 1):
            batch = sequences()[(t - 1) % EPOCH * BATCH : ((t - 1) % EPOCH + 1) * BATCH]
            info = StepInfo(step=t)
            plugins.targets(batch[:, 1:], info)
            loss = F.cross_entropy(model(batch[:, :-1]).reshape(-1, V), batch[:, 1:].reshape(-1))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            plugins.step_end(info)
            targets.append(batch[:, 1:].reshape(-1).numpy())
            rare.append(agg.last_gates.rare.numpy().copy())
    return agg, [w for w in caught if issubclass(w.category, AGGGatingWarning)], targets, rare


def window_counts(targets: list[np.ndarray], t: int, window: int = EPOCH) -> np.ndarray:
    """The counts of steps t − K + 1 … t (1-based), written out."""
    return np.bincount(np.concatenate(targets[max(t - window, 0) : t]), minlength=V)


def nearest_share(counts: np.ndarray, fraction: float) -> float:
    """The share of the target tokens, among those a count threshold can make rare (never-seen ids
    always rare, the special never), nearest `fraction` (the smaller on a tie)."""
    other = np.arange(V) != SPECIAL
    shares = [counts[other & (counts < v)].sum() / counts.sum() for v in np.unique(counts[other]) if v > 0]
    shares.append(counts[other].sum() / counts.sum())
    return min(sorted(shares), key=lambda s: abs(s - fraction))


# --- the warning -----------------------------------------------------------------------------------


def test_the_readme_settings_gate_nothing_in_300_steps_and_warn_once_naming_the_fix(caplog):
    with caplog.at_level(logging.WARNING, logger="aniso_plugins"):
        agg, caught, targets, rare = run(300, **README)
    for t in range(1, 301):
        assert window_counts(targets, t)[rare[t - 1]].sum() == 0, t  # no seen id is ever rare
    assert len(caught) == 1, [str(w.message) for w in caught]
    message = str(caught[0].message)
    logged = [r for r in caplog.records if r.name == "aniso_plugins" and r.levelno == logging.WARNING]
    assert [r.getMessage() for r in logged] == [message]
    tokens = EPOCH * BATCH * LENGTH
    for part in ("AGG gates no target token", f"at step {EPOCH}:", f"window={EPOCH} optimizer steps",
                 f"{tokens:,} target tokens seen", "alpha=0.03", "alpha_tokens=32768", "0.0% of the window's target tokens",
                 "alpha_tokens / alpha = 1,092,267 target tokens", "rare_fraction=0.05"):  # fmt: skip
        assert part in message, (part, message)
    # the alpha it suggests gates about 5% of that window (steps 1 … K), counted here
    suggested = float(re.search(r"would be alpha=([0-9.e+-]+) with alpha_tokens=32768", message).group(1))
    said = float(re.search(r"gating ([0-9.]+)% of the target tokens", message).group(1)) / 100
    counts = window_counts(targets, EPOCH)
    appearance = (32768 * counts / counts.sum()).astype(np.float32)
    gated = (appearance < np.float32(suggested)) & (np.arange(V) != SPECIAL)
    share = counts[gated].sum() / counts.sum()
    assert share == pytest.approx(said, abs=5e-4) and abs(share - 0.05) < 0.01


def test_more_than_half_gated_warns_once():
    _, caught, targets, rare = run(2 * EPOCH, alpha=40.0)  # per update: ids seen < 1000 times in 25 steps
    assert window_counts(targets, EPOCH)[rare[EPOCH - 1]].sum() / (EPOCH * BATCH * LENGTH) > 0.5
    assert len(caught) == 1
    message = str(caught[0].message)
    assert "AGG gates more than half of the target tokens" in message and f"at step {EPOCH}:" in message
    assert "rare_fraction=0.05 (instead of alpha) would gate about 5%" in message


@pytest.mark.parametrize("options", [dict(rare_fraction=0.05), dict(alpha=0.2)], ids=["rare_fraction", "alpha"])
def test_a_run_that_gates_does_not_warn(options):
    _, caught, targets, rare = run(2 * EPOCH, **options)
    assert caught == []
    for t in range(EPOCH, 2 * EPOCH + 1):
        share = window_counts(targets, t)[rare[t - 1]].sum() / (EPOCH * BATCH * LENGTH)
        assert 0 < share <= 0.5


def test_the_warning_reaches_the_hf_trainer_run_once(tmp_path, caplog):
    from transformers import Trainer, TrainingArguments

    from aniso_plugins.integrations.hf import AnisoCallback
    from hf_utils import TokenDataset, tiny_gpt2

    config = AnisoConfig(method="agg", window=3, metrics=(), load_entry_points=False, **README)
    args = TrainingArguments(report_to="none", use_cpu=True, disable_tqdm=True, save_strategy="no", max_steps=6,
                             per_device_train_batch_size=4, output_dir=str(tmp_path))  # fmt: skip
    trainer = Trainer(model=tiny_gpt2(), args=args, train_dataset=TokenDataset(n=8, length=8),
                      callbacks=[AnisoCallback(config)])  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="aniso_plugins"), pytest.warns(AGGGatingWarning) as caught:
        trainer.train()
    assert len([w for w in caught if w.category is AGGGatingWarning]) == 1
    assert "at step 3:" in str(caught[0].message) and "rare_fraction=0.05" in str(caught[0].message)
    assert len([r for r in caplog.records if "AGG gates no target token" in r.getMessage()]) == 1


# --- rare_fraction ---------------------------------------------------------------------------------


def test_rare_fraction_gates_about_that_share_of_every_full_window():
    window = EPOCH - 6  # not a whole epoch: every window holds other counts
    agg, caught, targets, rare = run(4 * EPOCH, rare_fraction=0.05, window=window)
    shares = []
    for t in range(window, 4 * EPOCH + 1):
        counts = window_counts(targets, t, window)
        assert not rare[t - 1][SPECIAL]
        shares.append(counts[rare[t - 1]].sum() / counts.sum())
        assert shares[-1] == pytest.approx(nearest_share(counts, 0.05), abs=1e-12), t
    assert len(set(shares)) > 10 and max(abs(s - 0.05) for s in shares) < 0.01, shares  # 4,864 target tokens a window
    assert caught == []
    metrics = agg.train_metrics(StepInfo(step=4 * EPOCH), {})
    assert metrics["agg/alpha"] == agg.last_alpha > 0


def test_rare_fraction_alpha_selects_the_nearest_share_with_the_strict_test():
    g = torch.Generator().manual_seed(3)
    probs = torch.arange(1, 301, dtype=torch.float64).pow(-1.2)
    counts = torch.bincount(torch.multinomial(probs, 5000, replacement=True, generator=g), minlength=300)
    c = counts.numpy()
    for appearance in (counts.float() / 7, (4096 * counts.double() / counts.sum()).float()):  # per update, per tokens
        appearance[SPECIAL] = 1.0
        for fraction in (0.001, 0.05, 0.2, 0.5, 0.9, 0.999):
            alpha, share = rare_fraction_alpha(counts, appearance, fraction, (SPECIAL,))
            rare = (appearance < alpha).numpy()
            rare[SPECIAL] = False
            assert alpha > 0 and rare[c == 0].all()
            assert share == pytest.approx(c[rare].sum() / c.sum(), abs=1e-12)
            assert share == pytest.approx(_nearest(c, fraction), abs=1e-12), fraction
    empty = torch.zeros(300, dtype=torch.int64)
    assert rare_fraction_alpha(empty, empty.float(), 0.05)[1] == 0.0
    with pytest.raises(ValueError, match="fraction=1.0: expected a number in \\(0, 1\\)"):
        rare_fraction_alpha(counts, appearance, 1.0)


def _nearest(c: np.ndarray, fraction: float) -> float:
    other = np.arange(c.size) != SPECIAL
    shares = [c[other & (c < v)].sum() / c.sum() for v in np.unique(c[other]) if v > 0] + [c[other].sum() / c.sum()]
    return min(sorted(shares), key=lambda s: abs(s - fraction))


def test_rare_fraction_keeps_the_specials_out_when_alpha_exceeds_one():
    agg, _, targets, rare = run(3, rare_fraction=0.9, window=3)
    counts = window_counts(targets, 3)
    assert agg.last_alpha > 1.0 and not rare[-1][SPECIAL]  # a_k = 1 < alpha, yet the special stays frequent
    assert counts[rare[-1]].sum() / counts.sum() == pytest.approx(nearest_share(counts, 0.9), abs=1e-12)


def test_rare_fraction_with_static_grouping_keeps_its_alpha_across_a_resume(tmp_path):
    agg, _, _, rare = run(6, rare_fraction=0.05, window=3, agg_static_after=3)
    assert all((r == rare[3]).all() for r in rare[3:])  # frozen after step 3
    state = agg.aniso_state_dict()["agg"]
    assert float(state["static_alpha"][0]) == agg.last_alpha
    fresh, *_ = run(1, rare_fraction=0.05, window=3, agg_static_after=3)
    fresh.aniso_load_state_dict({"agg": state})
    assert fresh._alpha(fresh.counter, fresh._static[0]) == agg.last_alpha


# --- the option ------------------------------------------------------------------------------------


def test_alpha_and_rare_fraction_are_exclusive_and_rare_fraction_is_checked():
    assert AnisoConfig(method="agg").alpha is None  # None: 0.03, the paper's semantics
    assert AnisoConfig(method="agg", rare_fraction=0.05).rare_fraction == 0.05
    with pytest.raises(ConfigError, match="alpha=0.03 and rare_fraction=0.05: set one of them"):
        AnisoConfig(method="agg", alpha=0.03, rare_fraction=0.05)
    with pytest.raises(ConfigError, match="alpha=0.1 and rare_fraction=0.2"):
        AnisoConfig(method="agg", rare_fraction=0.2).replace(alpha=0.1)
    for bad in (0, 1, 1.5, -0.1, float("nan"), "0.1", True):
        with pytest.raises(ConfigError, match="rare_fraction=.*: expected a number in \\(0, 1\\)"):
            AnisoConfig(rare_fraction=bad)
    assert "rare_fraction" in AnisoConfig.state_fields()


def test_the_parsers_carry_rare_fraction(tmp_path):
    from transformers import HfArgumentParser

    (cfg,) = HfArgumentParser(AnisoConfig).parse_args_into_dataclasses(["--method", "agg", "--rare_fraction", "0.05"])
    assert cfg == AnisoConfig(method="agg", rare_fraction=0.05)
    assert AnisoConfig.from_dict(cfg.to_dict()) == cfg


def test_saved_state_takes_alpha_none_and_0_03_as_the_same_alpha(tmp_path):
    from aniso_plugins import StateError
    from aniso_plugins.core.state import load_state, save_state

    fields = dict(method="agg", window=3, metrics=(), load_entry_points=False)
    save_state(tmp_path / "old.safetensors", {"agg": {"x": torch.zeros(1)}}, AnisoConfig(**fields, alpha=0.03).to_dict())
    save_state(tmp_path / "new.safetensors", {"agg": {"x": torch.zeros(1)}}, AnisoConfig(**fields).to_dict())
    for name in ("old", "new"):
        for config in (AnisoConfig(**fields), AnisoConfig(**fields, alpha=0.03)):
            load_state(tmp_path / f"{name}.safetensors", config.to_dict())
        with pytest.raises(StateError, match="alpha: saved 0.03, now 0.05"):
            load_state(tmp_path / f"{name}.safetensors", AnisoConfig(**fields, alpha=0.05).to_dict())
        with pytest.raises(StateError, match="rare_fraction: saved None, now 0.05"):
            load_state(tmp_path / f"{name}.safetensors", AnisoConfig(**fields, rare_fraction=0.05).to_dict())


def _ranks_warn(rank, world):
    _, caught, _, _ = run(4, window=3, **README)  # counts summed over the ranks: the same rare group on each
    return len(caught)


@pytest.mark.slow
def test_under_data_parallelism_the_first_rank_warns():
    from dist_utils import run_distributed

    assert run_distributed(_ranks_warn) == [1, 0]
