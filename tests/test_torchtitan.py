"""The torchtitan 0.3.0 adapter with torchtitan's real Trainer on CPU (tests/torchtitan_launcher.py).

End-to-end runs (subprocesses, 1 rank and 2 gloo ranks with FSDP2 dp_shard=2) of llama3's debug
model shrunk to 2 layers, on the project's own tokenizer and data (tests/torchtitan_data.py),
all starting from one seed checkpoint so that 1-rank and 2-rank runs share their initial
weights. They run once per module, a few at a time, and the tests compare their records.
"""

from __future__ import annotations

import json
import math
import os
import shutil

import pytest
import torch

pytest.importorskip("torchtitan")

from aniso_plugins import AnisoConfig, ConfigError, SetupError, hookimpl  # noqa: E402
from references import agg_output_grad  # noqa: E402
from torchtitan_data import rank_order, write_assets  # noqa: E402
from torchtitan_runs import Launcher, assert_aniso_report_reads_the_last_checkpoint  # noqa: E402

MOD = "aniso_plugins.integrations.torchtitan"
SEQ, LOCAL, WORLD2_LOCAL, N_DOCS = 32, 4, 2, 64
AGG = ["--aniso.method", "agg", "--aniso.alpha", "2.5", "--aniso.window", "3"]
NO_METRICS = ["--aniso.metrics"]  # an empty tuple: training only


# --- configuration, recipes, overrides (in process, no training) -----------------------------------
def test_aniso_flags_fill_the_section_and_bad_values_name_the_field(capsys):
    from torchtitan.config import ConfigManager

    base = ["--module", MOD, "--config", "llama3_debugmodel_aniso"]
    flags = ["--aniso.method", "agg", "--aniso.alpha", "0.05", "--aniso.window", "7", "--aniso.metrics", "geometry", "eval"]
    aniso = ConfigManager().parse_args(base + flags).aniso
    assert (aniso.method, aniso.alpha, aniso.window, aniso.metrics) == (("agg",), 0.05, 7, ("geometry", "eval"))
    assert aniso.fused_loss is None  # automatic: the fused AGG cross-entropy with torchtitan's own loss
    assert ConfigManager().parse_args(base + ["--aniso.fused-loss", "False"]).aniso.fused_loss is False
    with pytest.raises(SystemExit):
        ConfigManager().parse_args(base + ["--aniso.alpha", "-1"])
    assert "alpha=-1.0: expected a number > 0" in capsys.readouterr().err.replace("\n", " ").replace("│", "")


def test_recipes_install_the_aniso_components_and_turn_cuda_graphs_off():
    from aniso_plugins.integrations import torchtitan as tt
    from torchtitan.models.common.linear import Linear
    from torchtitan.models.llama3.config_registry import llama3_debugmodel_ce_loss

    recipes = [(tt.llama3_debugmodel_aniso, 2048, False), (tt.llama3_1b_aniso, 128256, True), (tt.llama3_3b_aniso, 128256, True)]
    for recipe, vocab, tied in recipes:
        cfg = recipe()
        model = cfg.model_spec.model
        assert isinstance(cfg, tt.AnisoTrainer.Config) and cfg.training.disable_cuda_graphs
        assert type(model.lm_head) is Linear.Config and model.lm_head.out_features == vocab  # the recipe's own head
        assert model.enable_weight_tying is tied
        assert type(cfg.loss) is tt.AnisoChunkedLoss.Config and cfg.loss.loss_fn.global_vocab_size == vocab
        assert type(cfg.metrics) is tt.AnisoMetricsProcessor.Config
        assert cfg.aniso == tt.default_config() and cfg.aniso.method == ("none",)
    with pytest.raises(SetupError, match="ChunkedLossWrapper"):
        tt.aniso_trainer_config(llama3_debugmodel_ce_loss())


def test_override_factories_swap_the_nodes_and_validate_their_json():
    from aniso_plugins.integrations import torchtitan as tt
    from torchtitan.config.override import OverrideConfig, apply_overrides
    from torchtitan.models.common.linear import Linear
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    def apply(kwargs):
        cfg = llama3_debugmodel()
        imports = [f"{MOD}.{name}" for name in ("aniso_metrics", "aniso_checkpoint")]
        imports.append((f"{MOD}.aniso_loss", kwargs))
        apply_overrides(OverrideConfig(imports=imports), cfg)
        return cfg

    cfg = apply({"method": "agg", "window": 100, "metrics": ["geometry", "frequency"]})
    assert type(cfg.model_spec.model.lm_head) is Linear.Config  # AGG patches the built head in place
    assert type(cfg.metrics) is tt.AnisoMetricsProcessor.Config
    assert type(cfg.checkpoint) is tt.AnisoCheckpointManager.Config
    assert type(cfg.loss) is tt.AnisoChunkedLoss.Config and cfg.loss.num_chunks == 8
    assert cfg.loss.aniso == AnisoConfig(method="agg", window=100, metrics=("geometry", "frequency"))
    with pytest.raises(ConfigError, match="unknown configuration fields"):
        apply({"methd": "agg"})
    with pytest.raises(ConfigError, match="method='bogus'"):
        apply({"method": "bogus"})


def test_agg_head_on_torchtitan_linear_is_linear_unarmed_and_the_token_normalized_cross_entropy_armed():
    import torch.nn.functional as F
    from aniso_plugins import TrainingHead, agg_gates
    from torchtitan.models.common.linear import Linear

    head = Linear.Config(in_features=8, out_features=16).build()
    installed = TrainingHead(head, chunk_size=3)
    h, y = torch.randn(2, 5, 8), torch.randint(0, 16, (2, 5))
    y[0, 0] = -100
    assert torch.equal(head(h), F.linear(h, head.weight))
    gates = agg_gates(torch.bincount(y[y >= 0], minlength=16).float(), alpha=1.5)
    installed.arm(y, gates)
    installed.fuse(torch.tensor(40))
    loss = head(h)  # Σ NLL / 40 (torchtitan's global_valid_tokens), not the mean over 9 targets
    expected = F.cross_entropy(F.linear(h, head.weight).double().reshape(-1, 16), y.reshape(-1), reduction="sum") / 40
    torch.testing.assert_close(loss.double(), expected, rtol=1e-6, atol=1e-7)
    assert torch.equal(head(h), F.linear(h, head.weight))  # one armed call only


def _fake_trainer(*, loss=None, head=None, graphs_off=True, tp=1, pp=1, cp=1, backend="spmd_types", dp_replicate=1,
                  dp_shard=1, inner_loss=None):
    from types import SimpleNamespace

    from torchtitan.models.common.linear import Linear

    head = head if head is not None else Linear.Config(in_features=8, out_features=16).build()
    model = torch.nn.Module()
    model.lm_head, model.tok_embeddings = head, torch.nn.Embedding(16, 8)
    return SimpleNamespace(
        step=0,
        gradient_accumulation_steps=1,
        loss_fn=loss if loss is not None else _chunked_loss(inner_loss),
        config=SimpleNamespace(training=SimpleNamespace(disable_cuda_graphs=graphs_off),
                               parallelism=SimpleNamespace(enable_sequence_parallel=True)),
        model_parts=[model],
        parallel_dims=SimpleNamespace(tp=tp, cp=cp, pp=pp, ep=1, dp_replicate=dp_replicate, dp_shard=dp_shard,
                                      spmd_backend=backend, get_optional_mesh=lambda *a, **k: None),
        optimizers=SimpleNamespace(register_step_post_hook=lambda hook: None),
        forward_backward_step=lambda **kwargs: None,
        train_step=lambda data_iterator: None,
        metrics_processor=SimpleNamespace(),
    )


def _chunked_loss(inner: str | None):
    from aniso_plugins.integrations.torchtitan import AnisoChunkedLoss
    from torchtitan.components.loss import MSELoss

    if inner == "mse":  # a chunked loss around another inner loss than cross-entropy
        return AnisoChunkedLoss.Config(loss_fn=MSELoss.Config()).build()
    return AnisoChunkedLoss.Config().build()


@pytest.mark.parametrize(
    "trainer_kw, config_kw, error, match",
    [
        (dict(graphs_off=False), {}, SetupError, "disable_cuda_graphs"),
        (dict(tp=2, backend="partial_dtensor"), {}, SetupError, "default 'spmd_types' backend"),
        (dict(pp=2), dict(metrics=("hidden", "ethayarajh")), SetupError,
         "'hidden' reads every block's outputs.*2 stages.*; 'ethayarajh' reads every block's outputs"),
        (dict(cp=2), {}, SetupError, r"context parallelism \(cp=2\) is refused.*context_parallel_degree 1"),
        ({}, dict(head="untie"), SetupError, "head='untie' adds parameters.*enable_weight_tying=False"),
        ({}, dict(ignore_index=0), ConfigError, "ignore_index=0"),
        ({}, dict(method="agg"), ConfigError, "--aniso.window"),
        (dict(inner_loss="mse"), dict(method="agg", window=5, fused_loss=True), ConfigError,
         "fused_loss=True: the inner loss is .*not torchtitan's cross-entropy"),
        (dict(loss=object()), {}, SetupError, "AnisoChunkedLoss"),
    ],
)
def test_unsupported_setups_raise_before_training(trainer_kw, config_kw, error, match, monkeypatch):
    from types import SimpleNamespace

    import aniso_plugins.integrations.torchtitan_layout as titan_layout
    from aniso_plugins.integrations.torchtitan import AnisoRuntime

    monkeypatch.setattr(titan_layout, "_stage_group", lambda pp: None)  # one process: no stage groups to make

    trainer = _fake_trainer(**trainer_kw)
    with pytest.raises(error, match=match):
        AnisoRuntime(trainer, AnisoConfig(**{"metrics": (), **config_kw}), SimpleNamespace(enable=False))
    head = trainer.model_parts[0].lm_head
    assert "forward" not in head.__dict__ and not head._forward_hooks  # nothing stays set up


def test_checkpoint_state_round_trips_and_refuses_another_configuration():
    from aniso_plugins import StateError
    from aniso_plugins.integrations.torchtitan import AnisoCheckpointState, AnisoRuntime

    def runtime(**kw):
        checkpointer = type("Checkpointer", (), {"enable": True, "states": {}})()
        AnisoRuntime(_fake_trainer(), AnisoConfig(method="agg", window=3, metrics=(), **kw), checkpointer)
        return checkpointer.states["aniso"]

    saved = runtime()
    session = saved.session
    session.begin_micro_batch(torch.tensor([[1, 2, 2, 5]]), step=1)
    session.handle.head()(torch.randn(1, 4, 8))  # the micro-batch's (gated) head forward
    session.end_step(1)
    blob = saved.state_dict()
    assert isinstance(saved, AnisoCheckpointState) and set(blob) == {"state"} and isinstance(blob["state"], bytes)
    loaded = runtime()
    loaded.load_state_dict(blob)
    state = loaded.session.plugins.state_dict()["agg"]
    assert state["ids"].tolist() == [1, 2, 5] and state["counts"].tolist() == [1, 2, 1] and int(state["step"][0]) == 2
    with pytest.raises(StateError, match="alpha"):
        runtime(alpha=0.5).load_state_dict(blob)


def _copy_checkpoint(src: str, dst: str, step: int) -> None:
    shutil.copytree(os.path.join(src, "checkpoint", f"step-{step}"), os.path.join(dst, "checkpoint", f"step-{step}"))


OVERRIDES = [
    "--override.imports",
    f"{MOD}.aniso_metrics,{MOD}.aniso_checkpoint",
    f'{MOD}.aniso_loss={json.dumps({"method": "agg", "alpha": 2.5, "window": 3, "metrics_every": 2})}',
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict]:
    root = str(tmp_path_factory.mktemp("titan"))
    assets = write_assets(os.path.join(root, "assets"), seq_len=SEQ, n_docs=N_DOCS, local_batch=WORLD2_LOCAL)
    launcher = Launcher(root, assets, local=LOCAL, world_local=WORLD2_LOCAL)
    # 1-rank runs start from torchtitan's seeded initialization; the 2-rank ones load it from a
    # seed checkpoint (FSDP2 initializes shards from per-rank random streams on CPU).
    seed = ["--checkpoint.initial_load_path", os.path.join(root, "seed", "checkpoint", "step-0")]
    agg_metrics = ["--aniso.metrics", "geometry", "eval", "--aniso.metrics_every", "2", "--metrics.log_freq", "4"]
    validate = ["--validator.enable", "--validator.freq", "4", "--validator.dataloader.dataset_path", assets["data_w1"]]
    cos = NO_METRICS + ["--aniso.method", "cosreg", "--aniso.reg_weight", "0.5", "--training.steps", "2"]
    simctg = NO_METRICS + ["--aniso.method", "simctg", "--aniso.simctg_weight", "2.0", "--training.steps", "1"]

    def copy(src: str, dst: str, step: int = 2):
        return lambda done: _copy_checkpoint(os.path.join(root, src), os.path.join(root, dst), step)

    return launcher.run_all([
        dict(name="seed", config="cpu_stock", args=["--checkpoint.create_seed_checkpoint", "--training.steps", "1"]),
        dict(name="agg_w2", config="cpu_aniso", args=seed + AGG + agg_metrics, world=2, after=["seed"]),
        dict(name="cos_w2", config="cpu_aniso", args=seed + cos, world=2, after=["seed"]),
        dict(name="stock", config="cpu_stock", args=[]),
        dict(name="agg", config="cpu_aniso", args=AGG + agg_metrics + validate),
        # 4 sequences per step as 2 micro-batches of 2: the term must still be added once
        dict(name="cos", config="cpu_aniso", args=cos + ["--training.global_batch_size", "4"], local=2),
        dict(name="none", config="cpu_aniso", args=NO_METRICS + ["--aniso.method", "none"]),
        # SimCTG on the whole micro-batch before torchtitan's 8 chunks: 2 micro-batches, or 2 ranks
        dict(name="simctg", config="cpu_aniso", args=seed + simctg + ["--training.global_batch_size", "4"], local=2, after=["seed"]),
        dict(name="simctg_w2", config="cpu_aniso", args=seed + simctg, world=2, after=["seed"]),
        # documents shorter than a sample: packed rows, positions restarting per document
        dict(name="simctg_packed", config="cpu_aniso", args=simctg, data="data_packed"),
        # every metric plugin with 2 micro-batches per step
        dict(name="metrics_ga", config="cpu_aniso", local=2, args=[
            "--aniso.metrics", "geometry", "frequency", "hidden", "bottleneck", "--aniso.metrics_every", "1",
            "--training.global_batch_size", "4", "--training.steps", "2",
        ]),
        dict(name="unfused", config="cpu_aniso", args=AGG + NO_METRICS + ["--aniso.fused-loss", "False", "--training.steps", "1"]),
        # compiled (torchtitan's blocks and its loss; aot_eager: dynamo and AOTAutograd without inductor's codegen)
        dict(name="agg_compile", config="cpu_aniso", args=AGG + NO_METRICS + [
            "--compile.enable", "--compile.backend", "aot_eager", "--training.steps", "2"]),
        # AGG's global batch of 4 as 2 accumulation steps of 2: "agg"'s gradients
        dict(name="agg_ga", config="cpu_aniso", local=2, args=AGG + NO_METRICS + [
            "--training.global_batch_size", "4", "--training.steps", "2"]),
        dict(name="override", config="cpu_stock", args=OVERRIDES + ["--metrics.log_freq", "4"]),
        # resume our own checkpoint (step 2 of "agg"), and a stock one (step 2 of "stock") with AGG on
        dict(name="agg_resume", config="cpu_aniso", args=AGG + agg_metrics + validate, after=["agg"], prepare=copy("agg", "agg_resume")),
        dict(
            name="from_stock", config="cpu_aniso", args=AGG + NO_METRICS + ["--checkpoint.exclude_from_loading", "aniso"],
            after=["stock"], prepare=copy("stock", "from_stock"),
        ),
    ])  # fmt: skip


@pytest.mark.slow
def test_every_metric_plugin_under_gradient_accumulation(runs):
    tb = runs["metrics_ga"]["tb"]
    for tag in ("aniso/geometry/head/isotropy", "aniso/frequency/rare/isotropy", "aniso/hidden/layer_0/mean_cosine",
                "aniso/hidden/layer_1/mean_cosine", "aniso/bottleneck/lost_fraction"):
        assert set(tb[tag]) == {1, 2}, tag
        assert all(math.isfinite(v) for v in tb[tag].values()), tag


# --- the run is stock torchtitan when nothing is on ------------------------------------------------
@pytest.mark.slow
def test_method_none_equals_stock_torchtitan(runs):
    stock, none = runs["stock"], runs["none"]
    loss = "loss_metrics/global_avg_loss"
    assert set(stock["tb"][loss]) == {1, 2, 3, 4}
    assert none["tb"][loss] == stock["tb"][loss]
    for name, value in stock["final_params"].items():
        assert torch.equal(none["final_params"][name], value), name
    assert not any(tag.startswith("aniso/") for tag in none["tb"])


# --- AGG ---------------------------------------------------------------------------------------------
def _step1_agg_reference(record: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(reference gated and plain head-weight gradients) from a 1-rank run's step-1 record."""
    labels = torch.cat(record["labels"])
    hidden = torch.cat(record["head_inputs"], dim=1) if len(record["head_inputs"]) > 1 else record["head_inputs"][0]
    W = record["params"]["lm_head.weight"]
    counts = torch.bincount(labels.reshape(-1), minlength=W.shape[0]).double()  # step 1: a_k = c_k / min(1, K)
    h, y = hidden.reshape(-1, W.shape[1]), labels.reshape(-1)
    gated = agg_output_grad(h, W, y, counts, 2.5, gated=True)
    plain = agg_output_grad(h, W, y, counts, 2.5, gated=False)
    return gated, plain


@pytest.mark.slow
@pytest.mark.parametrize("name", ["agg", "unfused"])
def test_agg_gradients_equal_the_reference_on_step_one(runs, name):
    record, stock = runs[name], runs["stock"]
    gated, plain = _step1_agg_reference(record)
    # the recorded inputs reproduce stock torchtitan's head gradient without gating ...
    torch.testing.assert_close(stock["grads"]["lm_head.weight"].double(), plain, rtol=1e-4, atol=1e-7)
    assert not torch.allclose(gated, plain, atol=1e-5)  # the gates do change this step
    # ... and AGG's head gradient is the gated one, everything else the plain cross-entropy's
    torch.testing.assert_close(record["grads"]["lm_head.weight"].double(), gated, rtol=1e-4, atol=1e-7)
    for param, grad in stock["grads"].items():
        if param != "lm_head.weight":
            torch.testing.assert_close(record["grads"][param], grad, rtol=1e-4, atol=1e-7, msg=param)
    if name == "agg":  # the fused head never forms logits: one call on the whole micro-batch
        assert len(record["head_inputs"]) == 1 and record["head_inputs"][0].shape == (LOCAL, SEQ, 256)
    else:  # torchtitan's 8 chunks, each gated by the core's gated_linear
        assert len(record["head_inputs"]) == 8


@pytest.mark.slow
def test_agg_counter_sums_all_ranks_and_two_ranks_train_like_one(runs):
    one, two = runs["agg"], runs["agg_w2"]
    assert rank_order(8, 2, 2) == [0, 1, 4, 5, 2, 3, 6, 7]  # the 2-rank file feeds the same global batches
    for param, value in one["params"].items():  # the seed checkpoint is the 1-rank initialization
        assert torch.equal(two["params"][param], value), param
    for param, grad in one["grads"].items():
        torch.testing.assert_close(two["grads"][param], grad, rtol=1e-4, atol=1e-7, msg=param)
    loss = "loss_metrics/global_avg_loss"
    for step, value in one["tb"][loss].items():
        assert two["tb"][loss][step] == pytest.approx(value, rel=1e-5)
    state1, state2 = one["aniso_state"]["agg"], two["aniso_state"]["agg"]
    assert int(state1["step"][0]) == 5  # 4 steps counted
    for key, value in state1.items():
        assert torch.equal(state2[key], value), key
    # after step 4 the K=3 window holds steps 3 and 4 (step 5 will be its third): 2 · 128 targets
    assert int(state1["counts"].sum()) + int(state1["current_counts"].sum()) == 2 * LOCAL * SEQ


@pytest.mark.slow
def test_agg_adds_no_host_read_to_torchtitans_step(runs):
    """Step 3 (no validation; not the step that fills AGG's window, which reads its gating check
    once a run): AGG's fused loss, counter and gates add no host read to stock torchtitan's step 3
    (tests/device_discipline.py's HostSyncs). The launcher logs every step (``log_freq = 1``), so
    the step ends with a measurement, whose one batched read of AGG's logged values is allowed
    (docs/performance.md §12.2)."""
    stock, agg = runs["stock"], runs["from_stock"]  # AGG from stock's step-2 checkpoint: its window starts at step 3
    ours = {site: n for site, n in agg["host_sync_sites"].items() if not site.endswith("(not ours)")}
    measured = {site: n for site, n in ours.items() if site.endswith(" train_metrics")}
    assert all(n <= 1 for n in measured.values()), measured
    ours = {site: n for site, n in ours.items() if site not in measured}
    # step 3 is the resumed process's first: torchdata's StatefulDataLoader creates its iterator
    # there (one .item() drawing the iterator's seed), as stock torchtitan resumed would; the
    # trainer's own reads are the same site by site
    first_iterator = {site for site in agg["host_sync_sites"] if "stateful_dataloader.py" in site and "__init__" in site}
    trainer = {site: n for site, n in agg["host_sync_sites"].items() if site not in first_iterator and site not in measured}
    assert trainer == stock["host_sync_sites"] and not ours, (agg["host_sync_sites"], stock["host_sync_sites"])
    assert sum(n for site, n in agg["host_sync_sites"].items() if site in first_iterator) <= 1


@pytest.mark.slow
def test_agg_trains_the_same_under_torchtitans_compile(runs):
    """``--compile.enable`` (what torchtitan's users turn on): the gradients of steps 1 and 2 are
    eager "agg"'s."""
    one, compiled = runs["agg"], runs["agg_compile"]
    assert "Compiling" in compiled["log"] or "compile" in compiled["log"].lower()
    for key in ("grads", "grads_step2"):
        for param, grad in one[key].items():
            torch.testing.assert_close(compiled[key][param], grad, rtol=1e-4, atol=1e-7, msg=f"{key} {param}")


@pytest.mark.slow
def test_agg_under_gradient_accumulation_trains_like_one_batch(runs):
    """Local batch 2 × 2 accumulation steps: the gradients of steps 1 and 2 are those of "agg"'s
    one batch of 4 (AGG counts the step's micro-batches before the first forward; before, the
    final parameters were 1.4e-2 off, stock torchtitan's split 7.1e-5)."""
    one, split = runs["agg"], runs["agg_ga"]
    assert len(split["labels"]) == 2 * len(one["labels"])  # the same sequences, in two micro-batches
    torch.testing.assert_close(torch.cat(split["labels"]), torch.cat(one["labels"]))
    for key in ("grads", "grads_step2"):
        for param, grad in one[key].items():
            torch.testing.assert_close(split[key][param], grad, rtol=1e-4, atol=1e-7, msg=f"{key} {param}")


@pytest.mark.slow
def test_metrics_reach_tensorboard_at_their_steps(runs):
    for name in ("agg", "override"):
        tb = runs[name]["tb"]
        assert set(tb["loss_metrics/global_avg_loss"]) == {1, 4}  # --metrics.log_freq 4
        assert set(tb["aniso/agg/rare_size"]) == {2, 4}  # --aniso.metrics_every 2 (2: off torchtitan's cadence)
    tb = runs["agg"]["tb"]
    for tag in ("aniso/geometry/head/mean_cosine", "aniso/geometry/embedding/isotropy"):
        assert set(tb[tag]) == {2, 4}, tag
    assert -1.0 <= tb["aniso/geometry/head/mean_cosine"][4] <= 1.0


@pytest.mark.slow
def test_validation_feeds_eval_metrics_and_neither_counts_nor_regularizes(runs):
    tb = runs["agg"]["tb"]  # --validator.freq 4: validation after steps 1 and 4, one batch each
    assert set(tb["validation_metrics/loss"]) == set(tb["validation_metrics/aniso/eval/ppl"]) == {1, 4}
    for step, loss in tb["validation_metrics/loss"].items():  # the same positions, the same NLL
        assert tb["validation_metrics/aniso/eval/ppl"][step] == pytest.approx(math.exp(loss), rel=1e-5)
    # "agg_w2" and "override" never validate: equal counters and weights mean validation neither
    # counted targets nor changed training (AGG gating only acts in training micro-batches)
    for key, value in runs["agg"]["aniso_state"]["agg"].items():
        assert torch.equal(runs["agg_w2"]["aniso_state"]["agg"][key], value), key


# --- regularizer -------------------------------------------------------------------------------------
def _cosreg_grad(W: torch.Tensor) -> torch.Tensor:
    """∇ of CosReg (Gao et al. 2019, docs/methods.md §3): (‖Σ_i w_i/‖w_i‖‖² − N)/N², float64."""
    W = W.double().requires_grad_(True)
    n = W.shape[0]
    total = (W / W.norm(dim=1, keepdim=True)).sum(0)
    ((total @ total - n) / n**2).backward()
    return W.grad


@pytest.mark.slow
def test_cosreg_gradient_is_added_once_per_step_with_torchtitans_sum_over_ranks(runs):
    stock = runs["stock"]  # 4 sequences in one micro-batch on one rank, no regularizer
    expected = stock["grads"]["lm_head.weight"].double() + 0.5 * _cosreg_grad(stock["params"]["lm_head.weight"])
    # the same 4 sequences as 2 micro-batches of 2 ("cos"), or 2 ranks x 2 ("cos_w2", each rank
    # adds 1/2 of the term and FSDP2 sums): the step's gradient is stock's + 0.5 ∇R, once
    for name in ("cos", "cos_w2"):
        grads = runs[name]["grads"]
        torch.testing.assert_close(grads["lm_head.weight"].double(), expected, rtol=1e-4, atol=1e-7, msg=name)
        for param, grad in stock["grads"].items():
            if param != "lm_head.weight":
                torch.testing.assert_close(grads[param], grad, rtol=1e-4, atol=1e-7, msg=f"{name} {param}")
    assert set(runs["cos"]["tb"]["aniso/loss/cosreg"]) == {1, 2}


def _simctg_reference(hidden: torch.Tensor, labels: torch.Tensor, margin: float = 0.5, positions=None) -> float:
    """SimCTG (Su et al. 2022) by explicit loops in float64: Σ over sequences and ordered pairs
    i ≠ j of valid positions of max(0, ρ − 1 + cos(h_i, h_j)), over the number of pairs; with
    `positions`, a sequence is one document of a row (a document starts where positions restart)."""
    total, pairs = 0.0, 0
    for b, (h, y) in enumerate(zip(hidden.double(), labels)):
        doc = [0] * len(y)
        for t in range(1, len(y)):
            doc[t] = doc[t - 1] + (positions is not None and int(positions[b, t]) != int(positions[b, t - 1]) + 1)
        idx = [t for t in range(len(y)) if y[t] != -100]
        for i in idx:
            for j in idx:
                if i != j and doc[i] == doc[j]:
                    total += max(0.0, margin - 1.0 + float(torch.nn.functional.cosine_similarity(h[i], h[j], dim=0)))
                    pairs += 1
    return total / pairs


@pytest.mark.slow
def test_simctg_terms_cover_whole_micro_batches_and_sum_over_ranks(runs):
    """torchtitan calls the head on 8 chunks of each sequence; the SimCTG pairs must still span
    the whole sequence (the adapter attaches the term to the whole micro-batch first)."""
    one, two = runs["simctg"], runs["simctg_w2"]
    chunks = len(one["head_inputs"]) // len(one["labels"])  # head calls per micro-batch
    hidden = [torch.cat(one["head_inputs"][i : i + chunks], dim=1) for i in range(0, len(one["head_inputs"]), chunks)]
    expected = sum(_simctg_reference(h, y) for h, y in zip(hidden, one["labels"])) / len(hidden)
    assert one["tb"]["aniso/loss/simctg"][1] == pytest.approx(2.0 * expected, rel=1e-4)
    # the same 4 sequences as 2 micro-batches on 1 rank or 1 micro-batch on each of 2 ranks (all
    # sequences full, so every micro-batch has the same number of pairs): the same step gradient
    assert two["tb"]["aniso/loss/simctg"][1] == pytest.approx(one["tb"]["aniso/loss/simctg"][1], rel=1e-4)
    for name, grad in one["grads"].items():
        torch.testing.assert_close(two["grads"][name], grad, rtol=1e-4, atol=1e-6, msg=name)
    assert any((one["grads"][n] - g).abs().max() > 1e-6 for n, g in runs["none"]["grads"].items() if n in one["grads"])


@pytest.mark.slow
def test_simctg_pairs_stay_inside_each_document_of_a_packed_row(runs):
    """torchtitan packs several documents into a row and masks attention per document: SimCTG's
    pairs are those of each document (whole-row pairs would be another, larger loss)."""
    run = runs["simctg_packed"]
    (labels,), (positions,) = run["labels"], run["positions"]
    hidden = torch.cat(run["head_inputs"], dim=1)  # the 8 chunks of the one micro-batch
    assert (positions == 0).sum(-1).min() >= 2  # every row holds two documents or more
    expected = _simctg_reference(hidden, labels, positions=positions)
    assert run["tb"]["aniso/loss/simctg"][1] == pytest.approx(2.0 * expected, rel=1e-4)
    assert abs(_simctg_reference(hidden, labels) - expected) > 0.05 * expected


# --- override path, checkpoints ----------------------------------------------------------------------
@pytest.mark.slow
def test_override_path_on_a_stock_recipe_trains_exactly_like_the_flag_path(runs):
    flag, over = runs["agg"], runs["override"]
    assert "AnisoChunkedLoss" in over["log"]  # torchtitan logs the swap
    for name, value in flag["final_params"].items():
        assert torch.equal(over["final_params"][name], value), name
    for key, value in flag["aniso_state"]["agg"].items():
        assert torch.equal(over["aniso_state"]["agg"][key], value), key


@pytest.mark.slow
def test_resume_from_checkpoint_is_exact(runs):
    full, resumed = runs["agg"], runs["agg_resume"]
    assert "Training starts at step 3" in resumed["log"]
    for name, value in full["final_params"].items():
        assert torch.equal(resumed["final_params"][name], value), name
    for key, value in full["aniso_state"]["agg"].items():
        assert torch.equal(resumed["aniso_state"]["agg"][key], value), key
    assert resumed["tb"]["aniso/agg/rare_size"][4] == full["tb"]["aniso/agg/rare_size"][4]


@pytest.mark.slow
def test_stock_checkpoint_resumes_with_exclude_from_loading(runs):
    record = runs["from_stock"]
    assert "Training starts at step 3" in record["log"]
    assert "no AGG state was restored" in record["log"]  # the counter starts empty, and says so
    assert int(record["aniso_state"]["agg"]["step"][0]) == 3  # it counted steps 3 and 4 only


def test_document_masking_positions_split_packed_rows_into_their_documents():
    """torchtitan's document masking hands the loss `positions` restarting at each document of a
    packed row: the plugins see those documents (SimCTG pairs and IntraSim sentences stay in one)."""
    from types import SimpleNamespace

    from aniso_plugins.integrations.torchtitan import AnisoRuntime

    trainer = _fake_trainer()
    trainer.metrics_processor = SimpleNamespace(should_log=lambda step: False)
    runtime = AnisoRuntime(trainer, AnisoConfig(metrics=(), load_entry_points=False), SimpleNamespace(enable=False))
    trainer.loss_fn.set_lm_head(trainer.model_parts[0].lm_head)
    seen = []

    class Probe:
        @hookimpl
        def aniso_targets(self, targets, step):
            seen.append((targets, step.sequence_ids))

    runtime.session.plugins.pm.register(Probe())
    trainer.step = 1
    labels = torch.randint(0, 16, (2, 8))  # 8 positions: torchtitan's 8 chunks of one
    positions = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4], [0, 1, 2, 3, 4, 5, 6, 7]])
    pred = torch.randn(2, 8, 8, requires_grad=True)
    trainer.loss_fn(pred, labels, torch.tensor(12), positions=positions)
    trainer.loss_fn(pred, labels, torch.tensor(12))  # no document masking: each row is one sequence
    assert seen[0][0] is labels  # torchtitan's labels are aligned with the head's outputs already
    assert seen[0][1].tolist() == [[0, 0, 0, 1, 1, 1, 1, 1], [0] * 8] and seen[1][1] is None


@pytest.mark.slow
@pytest.mark.parametrize("name", ["agg", "agg_w2"])  # one rank; two FSDP2 ranks (sharded .distcp files)
def test_aniso_report_reads_the_dcp_checkpoint_torchtitan_wrote(runs, name, tmp_path):
    assert_aniso_report_reads_the_last_checkpoint(runs[name], tmp_path)
