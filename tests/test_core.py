"""Configuration, plugin manager, hooks, loss attachment and state files (single process)."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from aniso_plugins import (
    AnisoConfig,
    AnisoPlugins,
    ConfigError,
    ModelHandle,
    SetupError,
    RunInfo,
    Stat,
    StateError,
    StepInfo,
    TrainingSession,
    attach_loss,
    hookimpl,
)
from third_party_plugin import HeadNormPlugin


class TinyLM(nn.Module):
    def __init__(self, vocab=11, dim=5, tied=True):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList([nn.Linear(dim, dim), nn.Linear(dim, dim)])
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        if tied:
            self.lm_head.weight = self.embed.weight

    def forward(self, ids):
        h = self.embed(ids)
        for b in self.blocks:
            h = torch.tanh(b(h))
        return self.lm_head(h)


# --- configuration --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"method": "agk"}, ["method='agk'", "agg", "cosreg"]),
        ({"alpha": 0.0}, ["alpha=0.0", "> 0"]),
        ({"alpha": float("nan")}, ["alpha=nan"]),
        ({"window": 0}, ["window=0", ">= 1"]),
        ({"window": 2.5}, ["window=2.5", "integer"]),
        ({"hinge_margin": 1.5}, ["hinge_margin=1.5", "[-1, 1]"]),
        ({"metrics": ("geometry", "spectra")}, ["metrics='spectra'", "hidden"]),
        ({"group_fractions": (0.2, 0.2, 0.2)}, ["group_fractions", "summing to 1"]),
        ({"head": "lowrank"}, ["lowrank_rank=None", "rank"]),
        ({"agg_parts": ("b", "d")}, ["agg_parts='d'", "a, b, c"]),
        ({"special_ids": (-1,)}, ["special_ids", ">= 0"]),
    ],
)
def test_config_rejects_bad_values_naming_field_value_and_range(kwargs, words):
    with pytest.raises(ConfigError) as e:
        AnisoConfig(**kwargs)
    for w in words:
        assert w in str(e.value)


def test_config_round_trips_through_json_and_accepts_flag_strings():
    c = AnisoConfig(method="agg", alpha=0.08, special_ids="0, 1,2", metrics="geometry,frequency")
    assert c.special_ids == (0, 1, 2) and c.metrics == ("geometry", "frequency")
    again = AnisoConfig.from_dict(json.loads(json.dumps(c.to_dict())))
    assert again == c
    with pytest.raises(ConfigError, match="unknown configuration fields.*'alhpa'"):
        AnisoConfig.from_dict({"alhpa": 0.1})


# --- plugin manager and hooks ---------------------------------------------------------------


class Recorder:
    name = "recorder"

    def __init__(self):
        self.events = []

    @hookimpl
    def aniso_setup(self, model, config):
        self.events.append(("setup", model.vocab_size))

    @hookimpl
    def aniso_targets(self, targets, step):
        self.events.append(("targets", step.step, step.micro_batch, targets.tolist()))

    @hookimpl
    def aniso_step_end(self, step):
        self.events.append(("step_end", step.step))

    @hookimpl
    def aniso_begin_training(self, run):
        self.events.append(("begin_training", run.epoch_steps, run.start_step))

    @hookimpl
    def aniso_metric_stats(self, step, kind, round_index, reduced):
        # two rounds: the second depends on the reduced first
        self.events.append(("round", round_index, sorted(reduced)))
        if round_index == 0:
            return {"recorder/a": Stat(torch.tensor([2.0, 3.0]))}
        if round_index == 1:
            return {"recorder/b": Stat(reduced["recorder/a"] * 10, "max")}
        return None

    @hookimpl
    def aniso_metrics(self, step, kind, reduced):
        return {"recorder/b0": float(reduced["recorder/b"][0]), "recorder/kind_is_eval": float(kind == "eval")}

    @hookimpl
    def aniso_log(self, metrics, step, kind):
        self.events.append(("log", step, sorted(metrics)))


def test_manager_drives_hooks_in_order_and_runs_metric_rounds():
    rec = Recorder()
    plugins = AnisoPlugins(AnisoConfig(metrics=(), load_entry_points=False), plugins=[rec])
    assert plugins.get("recorder") is rec
    plugins.setup(ModelHandle(TinyLM(), input_embedding="embed", blocks="blocks"))
    plugins.begin_training(RunInfo(epoch_steps=5, start_step=0))
    step = StepInfo(step=1, micro_batch=0, accumulation_steps=2)
    plugins.targets(torch.tensor([1, 2]), step)
    plugins.step_end(step)
    metrics = plugins.measure(step)
    assert metrics == {"aniso/recorder/b0": 20.0, "aniso/recorder/kind_is_eval": 0.0}
    plugins.log(metrics, 1)
    assert rec.events == [
        ("setup", 11),
        ("begin_training", 5, 0),
        ("targets", 1, 0, [1, 2]),
        ("step_end", 1),
        ("round", 0, []),
        ("round", 1, ["recorder/a"]),
        ("round", 2, ["recorder/a", "recorder/b"]),
        ("log", 1, ["aniso/recorder/b0", "aniso/recorder/kind_is_eval"]),
    ]
    with pytest.raises(ConfigError, match="two plugins are named 'recorder'"):
        plugins.register(Recorder())


def test_example_plugin_loss_term_reaches_gradients_and_metric_reaches_output():
    torch.manual_seed(0)
    model = TinyLM()
    plugin = HeadNormPlugin(coef=0.3)
    session = TrainingSession(AnisoConfig(metrics=(), load_entry_points=False), plugins=[plugin])
    session.setup(ModelHandle(model, input_embedding="embed"))
    session.begin_training()
    ids = torch.randint(0, 11, (2, 4))
    session.begin_micro_batch(ids, step=1)
    logits = model(ids)  # the session's head hook attaches the loss term
    nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten()).backward()
    got = model.lm_head.weight.grad.clone()

    model.zero_grad()
    ref_loss = nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten())
    (ref_loss + 0.3 * model.lm_head.weight.pow(2).sum()).backward()
    torch.testing.assert_close(got, model.lm_head.weight.grad, rtol=1e-6, atol=1e-7)

    metrics = session.measure(1)
    w = model.lm_head.weight.detach().double()
    assert metrics["aniso/head_norm/rms_row_norm"] == pytest.approx(float((w.pow(2).sum() / 11).sqrt()), rel=1e-12)
    assert metrics["aniso/loss/head_l2"] == pytest.approx(float(0.3 * w.pow(2).sum()), rel=1e-6)


@pytest.mark.parametrize("every_microbatch, due", [(False, [0, 0, 1]), (True, [1, 1, 1])])
def test_loss_terms_apply_once_per_optimizer_step_under_accumulation(every_microbatch, due):
    calls = []

    class Counting(HeadNormPlugin):
        @hookimpl
        def aniso_loss_terms(self, step):
            calls.append(step.micro_batch)
            return super().aniso_loss_terms(step)

    config = AnisoConfig(metrics=(), load_entry_points=False, reg_every_microbatch=every_microbatch)
    session = TrainingSession(config, plugins=[Counting()])
    model = TinyLM()
    session.setup(ModelHandle(model))
    session.begin_training(accumulation_steps=3)
    for m in range(3):
        ids = torch.randint(0, 11, (2, 4))
        session.begin_micro_batch(ids, step=1, accumulation_steps=3)
        model(ids)
    assert [int(m in calls) for m in range(3)] == due


def test_entry_point_plugins_are_discovered(tmp_path, monkeypatch):
    dist_info = tmp_path / "head_norm_plugin-1.0.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: head-norm-plugin\nVersion: 1.0\n")
    (dist_info / "entry_points.txt").write_text("[aniso_plugins]\nhead_norm_plugins = third_party_plugin\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    plugins = AnisoPlugins(AnisoConfig(metrics=()))
    assert "head_norm" in plugins.names  # the object built by the module's aniso_make_plugins
    off = AnisoPlugins(AnisoConfig(metrics=(), load_entry_points=False))
    assert "head_norm" not in off.names


def test_attach_loss_scales_the_term_and_leaves_the_value():
    x = torch.randn(3, requires_grad=True)
    w = torch.randn(3, requires_grad=True)
    out = attach_loss(x * 2, (w**2).sum(), scale=0.5)
    assert torch.equal(out, x * 2)
    out.sum().backward()
    torch.testing.assert_close(w.grad, 0.5 * 2 * w.detach())
    torch.testing.assert_close(x.grad, torch.full((3,), 2.0))
    with pytest.raises(ValueError, match="scalar"):
        attach_loss(x, w)


def test_model_handle_errors_and_untie():
    with pytest.raises(SetupError, match="no submodule 'head'"):
        ModelHandle(TinyLM(), head="head")
    m = TinyLM()
    m.lm_head = nn.Identity()
    with pytest.raises(SetupError, match="no 2-D `weight`"):
        ModelHandle(m)
    flagged = []
    model = TinyLM()
    h = ModelHandle(model, input_embedding="embed", on_untie=lambda: flagged.append(True))
    assert h.tied()
    h.untie()
    assert not h.tied() and flagged == [True]
    assert torch.equal(model.lm_head.weight, model.embed.weight)


# --- state files ----------------------------------------------------------------------------


class Counter:
    name = "counter"

    def __init__(self):
        self.counts = torch.zeros(4, dtype=torch.int64)

    @hookimpl
    def aniso_state_dict(self):
        return {"counter": {"counts": self.counts}}

    @hookimpl
    def aniso_load_state_dict(self, state):
        self.counts = state["counter"]["counts"].clone()


def test_state_round_trip_and_refusals(tmp_path):
    cfg = AnisoConfig(method="none", window=7, metrics=(), load_entry_points=False)
    a = Counter()
    a.counts += torch.tensor([1, 2, 3, 4])
    AnisoPlugins(cfg, plugins=[a]).save(tmp_path / "s.safetensors")
    b = Counter()
    AnisoPlugins(cfg, plugins=[b]).load(tmp_path / "s.safetensors")
    assert torch.equal(b.counts, a.counts)
    assert not list(tmp_path.glob("*.tmp*"))

    other = AnisoConfig(method="none", window=7, alpha=0.05, metrics=(), load_entry_points=False)
    with pytest.raises(StateError, match="alpha: saved 0.03, now 0.05.*on_state_mismatch='reset'"):
        AnisoPlugins(other, plugins=[Counter()]).load(tmp_path / "s.safetensors")
    # cadence fields may change on resume, and so may the window (the AGG counter re-cuts it)
    for changed in (dict(metrics_every=5), dict(window=8)):
        fields = dict(method="none", window=7, metrics=(), load_entry_points=False) | changed
        AnisoPlugins(AnisoConfig(**fields), plugins=[Counter()]).load(tmp_path / "s.safetensors")

    from safetensors.torch import save_file

    save_file({"x": torch.zeros(1)}, tmp_path / "foreign.safetensors", metadata={"format": "pt"})
    with pytest.raises(StateError, match="not an aniso_plugins state file"):
        AnisoPlugins(cfg, plugins=[Counter()]).load(tmp_path / "foreign.safetensors")
    save_file({"x": torch.zeros(1)}, tmp_path / "v9.safetensors", metadata={"format": "aniso_plugins.core.state", "version": "9"})
    with pytest.raises(StateError, match="format version 9"):
        AnisoPlugins(cfg, plugins=[Counter()]).load(tmp_path / "v9.safetensors")


def test_plugins_that_collide_are_named():
    class Term:
        def __init__(self, name):
            self.name = name

        @hookimpl
        def aniso_loss_terms(self, step):
            return {"l2": torch.zeros((), requires_grad=True)}

    plugins = AnisoPlugins(AnisoConfig(metrics=(), load_entry_points=False), plugins=[Term("a"), Term("b")])
    with pytest.raises(ConfigError, match="two plugins returned a loss term named 'l2'"):
        plugins.loss_terms(StepInfo(step=1))
