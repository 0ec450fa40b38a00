"""`ParallelLayout`: one value per run, given once at set-up, held by the session; the plugins
refuse what they cannot serve (`aniso_refuse_layout`) before anything changes; the layout's world
is in force during the session's calls only (no process-wide setting)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from aniso_plugins import AnisoConfig, ModelHandle, ParallelLayout, SetupError, TrainingSession, hookimpl
from aniso_plugins.numerics.distributed import in_world, world_group

V, D = 12, 6


def _handle(seed: int = 0, tied: bool = False) -> ModelHandle:
    torch.manual_seed(seed)
    model = nn.Module()
    model.embed, model.blocks, model.lm_head = nn.Embedding(V, D), nn.ModuleList([nn.Linear(D, D)]), nn.Linear(D, V)
    if tied:
        model.lm_head.weight = model.embed.weight
    return ModelHandle(model, head="lm_head", input_embedding="embed", blocks="blocks")


def _session(**config) -> TrainingSession:
    return TrainingSession(AnisoConfig(**{"metrics": (), "load_entry_points": False, **config}))


def _untouched(handle: ModelHandle) -> bool:
    head = handle.model.lm_head
    return "forward" not in head.__dict__ and not head._forward_hooks and not head._forward_pre_hooks


class RefusesTwoStages:
    """A third party's plugin that cannot serve pipeline parallelism."""

    name = "third_party"

    @hookimpl
    def aniso_refuse_layout(self, layout: ParallelLayout) -> str | None:
        return "third_party needs the whole model on each rank" if layout.pipeline_stages > 1 else None


def test_a_plugin_refuses_a_layout_before_anything_changes():
    handle = _handle()
    session = TrainingSession(AnisoConfig(metrics=("geometry",), load_entry_points=False), [RefusesTwoStages()])
    with pytest.raises(SetupError, match="^third_party needs the whole model on each rank$"):
        session.setup(handle, ParallelLayout(pipeline_stages=2))
    assert _untouched(handle) and session.handle is None
    session.setup(handle, ParallelLayout(pipeline_micro_batches=3))  # one stage: served
    assert handle.layout.pipeline_micro_batches == 3 and session.layout is handle.layout


def test_a_bypassed_head_refuses_each_method_acting_in_it_and_serves_metrics():
    """Liger's kernel (``head_bypassed``): every method that acts in the head's forward says so,
    in the configuration's order; metrics alone still run."""
    bypassed = ParallelLayout(head_bypassed="Liger bypasses (turn Liger off)")
    handle = _handle()
    with pytest.raises(SetupError) as refused:
        _session(method=("agg", "simctg"), window=2).setup(handle, bypassed)
    assert str(refused.value) == ("'agg' acts in the LM head's forward, which Liger bypasses (turn Liger off); "
                                  "'simctg' acts in the LM head's forward, which Liger bypasses (turn Liger off)")
    assert _untouched(handle)
    _session(metrics=("geometry",)).setup(handle, bypassed)


def test_fixed_parameters_refuse_head_surgery_and_keep_the_tying():
    handle = _handle(tied=True)
    with pytest.raises(SetupError, match="^head='untie' adds parameters to the model, but the optimizer exists$"):
        _session(head="untie").setup(handle, ParallelLayout(parameters_fixed="the optimizer exists"))
    assert handle.model.lm_head.weight is handle.model.embed.weight


@pytest.mark.parametrize("field, value", [("batch_copies", 0), ("pipeline_stages", 1.5), ("pipeline_micro_batches", True),
                                          ("gradient_weight", 0.0)])
def test_a_layout_of_impossible_sizes_is_refused_naming_the_field(field, value):
    with pytest.raises(ValueError, match=rf"ParallelLayout\({field}={value!r}\)"):
        ParallelLayout(**{field: value})


def test_the_layout_scales_what_the_session_counts():
    """Pipeline micro-batches multiply the trainer's accumulation steps; the gradient weight of a
    summing engine multiplies the loss terms' weight (reference: the numbers written out)."""
    session = _session()
    session.setup(_handle(), ParallelLayout(pipeline_micro_batches=4, gradient_weight=0.25))
    run = session.begin_training(accumulation_steps=2, loss_scale=3.0)
    assert run.accumulation_steps == 8
    assert session.begin_micro_batch(torch.zeros(2, 3, dtype=torch.long), step=1, accumulation_steps=2).accumulation_steps == 8
    assert session._gradient_scale(torch.device("cpu")) == 0.75


def test_the_world_is_in_force_only_inside():
    group = object()
    assert world_group() is None
    with in_world(group):
        assert world_group() is group
        with in_world(None):
            assert world_group() is None
        assert world_group() is group
    assert world_group() is None


def _own_world_measures(rank: int, world: int) -> dict:
    import torch.distributed as dist

    groups = [dist.new_group([r]) for r in range(world)]  # collective: every rank makes every group
    handle = _handle(seed=rank)
    session = _session(metrics=("geometry",))
    session.setup(handle, ParallelLayout(world=groups[rank]))
    session.begin_training()
    own = session.measure(1)["aniso/geometry/head/mean_cosine"]
    outside = world_group()
    shared = _session(metrics=("geometry",))  # a second session in the same process: the default world
    shared.setup(_handle(seed=0))  # the same weight on every rank: a DDP replica
    shared.begin_training()
    return {"own": own, "shared": shared.measure(1)["aniso/geometry/head/mean_cosine"], "outside": outside,
            "weight": handle.model.lm_head.weight.detach().double().numpy()}


def _mean_cosine(w: np.ndarray) -> float:
    """Mean cosine over ordered pairs i ≠ j, written out."""
    u = w / np.linalg.norm(w, axis=1, keepdims=True)
    cos = u @ u.T
    n = len(w)
    return float((cos.sum() - np.trace(cos)) / (n * (n - 1)))


@pytest.mark.slow
def test_each_session_holds_its_own_world_on_two_ranks():
    """Two gloo ranks, each with a session whose world is itself (as a pipeline stage of one
    rank would be) and a model of its own: each measures its own model only; a second session
    in the same processes, on the default world, measures the replica over both ranks; nothing
    of the first world is left in force outside its calls."""
    from dist_utils import run_distributed

    results = run_distributed(_own_world_measures, world=2)
    for rank, result in enumerate(results):
        assert result["outside"] is None
        assert result["own"] == pytest.approx(_mean_cosine(result["weight"]), abs=1e-12)
        assert result["shared"] == pytest.approx(_mean_cosine(results[0]["weight"]), abs=1e-12)
    assert results[0]["own"] != pytest.approx(results[1]["own"], abs=1e-6)


def test_the_hf_trainer_s_layout_refuses_head_surgery_after_its_optimizer_and_serves_liger(tmp_path):
    """Through a real ``transformers.Trainer``: an optimizer given to it fixes the parameters (the
    head plugin refuses ``head='untie'``, the model stays tied); under Liger's kernel AGG is served
    with Liger's fused cross-entropy set aside for the fused loss (tests/test_liger.py); metrics
    alone are served under both."""
    pytest.importorskip("transformers")
    from hf_utils import TokenDataset, tiny_gpt2
    from transformers import Trainer, TrainingArguments

    from aniso_plugins.integrations.hf import AnisoCallback

    def trainer(config: AnisoConfig, model=None, optimizer=None, **args) -> Trainer:
        model = model if model is not None else tiny_gpt2()
        quiet = dict(report_to="none", use_cpu=True, disable_tqdm=True, save_strategy="no")
        return Trainer(model=model, args=TrainingArguments(output_dir=str(tmp_path), max_steps=1, **quiet, **args),
                       train_dataset=TokenDataset(), callbacks=[AnisoCallback(config)],
                       optimizers=(optimizer, None) if optimizer is not None else (None, None))

    model = tiny_gpt2()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(SetupError, match="^head='untie' adds parameters to the model, but the Trainer was given an "
                                         "optimizer already; let the Trainer create its optimizer$"):
        trainer(AnisoConfig(head="untie", metrics=(), load_entry_points=False), model, optimizer)
    assert model.lm_head.weight is model.transformer.wte.weight
    trainer(AnisoConfig(metrics=("geometry",), load_entry_points=False), model, optimizer)
    served = trainer(AnisoConfig(method="agg", window=2, metrics=(), load_entry_points=False), use_liger_kernel=True)
    assert served.args.liger_kernel_config == {"fused_linear_cross_entropy": False}
