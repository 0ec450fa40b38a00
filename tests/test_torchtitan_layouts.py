"""Every parallel layout torchtitan 0.3.0 runs on the CPU, with aniso_plugins on, against a
1-rank run of the same global batch from the same seed checkpoint (torchtitan's real Trainer,
gloo, tests/torchtitan_launcher.py): dp_replicate, HSDP, tensor parallelism (the vocabulary-
parallel fused AGG loss; sequence parallelism on), FSDP2 + TP, pipeline parallelism with each of
torchtitan's six schedules, expert parallelism on a Qwen3 mixture of experts. Each multi-rank run
must give the step-1 and step-2 gradients of every parameter, every logged ``aniso/...`` value
and the plugin state (AGG's counter, the target counts) of its reference, within 1e-5 relative.

The references match what each layout splits: a rank's micro-batch is its share of the step,
so the reference of pipeline parallelism (4 pipeline micro-batches per step) runs the same
micro-batches as gradient accumulation; the uniformity of hidden states, a per-micro-batch
estimate, is compared under TP, where each rank's micro-batch is the whole batch. Checkpoints written under TP, HSDP and PP resume
exactly, and `aniso report` reads the TP and HSDP ones."""

from __future__ import annotations

import math
import os
import shutil

import pytest
import torch

pytest.importorskip("torchtitan")

from torchtitan_data import write_assets, write_dataset  # noqa: E402
from torchtitan_runs import Launcher, assert_aniso_report_reads_the_last_checkpoint  # noqa: E402

SEQ, N_DOCS, STEPS = 32, 64, 4
COMMON = ["--aniso.alpha", "2.5", "--aniso.window", "3", "--aniso.metrics_every", "1", "--training.steps", str(STEPS)]
A = ["--aniso.method", "agg", "cosreg", "simctg", "--aniso.reg_weight", "0.5", "--aniso.simctg_weight", "2.0",
     "--aniso.metrics", "geometry", "frequency", "hidden", "under_trained"]
EVAL = ["eval", "--validator.enable", "--validator.freq", "2"]  # appended to A: "eval" joins the metrics
B = ["--aniso.method", "hinge", "uniformity", "--aniso.reg_weight", "0.5", "--aniso.uniformity_on", "hidden",
     "--aniso.uniformity_weight", "0.3", "--aniso.metrics", "geometry"]
C = ["--aniso.method", "agg", "spectrum", "--aniso.reg_weight", "0.5", "--aniso.fused-loss", "False",
     "--aniso.metrics", "geometry"]
D = ["--aniso.method", "coupled_adam", "mu_centering", "--aniso.metrics", "geometry"]
E = ["--aniso.method", "mu_loss", "--aniso.mu_loss_weight", "10.0", "--aniso.metrics", "geometry"]
TP2 = ["--parallelism.tensor_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1"]
PP2 = ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1"]
SCHEDULES = ("1F1B", "GPipe", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble")
GA4 = ["--training.global_batch_size", "4"]

# name: (reference, world, data file, sequences per rank and micro-batch, flags)
LAYOUTS = {
    "dp_replicate": ("one_A", 2, "data_w2", 2, A + ["--parallelism.data_parallel_replicate_degree", "2",
                                                    "--parallelism.data_parallel_shard_degree", "1"]),
    "hsdp": ("one_A", 4, "data_w4", 1, A + EVAL + ["--parallelism.data_parallel_replicate_degree", "2",
                                                   "--parallelism.data_parallel_shard_degree", "2"]),
    "tp": ("one_A", 2, "data_w1", 4, A + EVAL + TP2),
    "fsdp_tp": ("one_A", 4, "data_w2", 2, A + ["--parallelism.data_parallel_shard_degree", "2",
                                               "--parallelism.tensor_parallel_degree", "2"]),
    "tp_hinge_uniformity": ("one_B", 2, "data_w1", 4, B + TP2),
    "tp_spectrum_unfused": ("one_C", 2, "data_w1", 4, C + TP2),
    # Coupled Adam's vocabulary mean and μ-centering's mean row over FSDP2 x TP row shards (2-D DTensors)
    "fsdp_tp_coupled_centering": ("one_D", 4, "data_w2", 2, D + ["--parallelism.data_parallel_shard_degree", "2",
                                                               "--parallelism.tensor_parallel_degree", "2"]),
    "tp_mu_loss": ("one_E", 2, "data_w1", 4, E + TP2),
    **{f"pp_{s}": ("one_A_ga4", 2, "data_w1", 4, A + (EVAL if s == "1F1B" else [])
                   + [a for a in PP2] + ["--parallelism.pipeline_parallel_schedule", s]) for s in SCHEDULES},
    "ep": ("one_moe", 2, "data_w2", 2, A + ["--parallelism.data_parallel_shard_degree", "2",
                                            "--parallelism.expert_parallel_degree", "2"]),
}
for _name in ("pp_1F1B", "pp_GPipe", "pp_Interleaved1F1B", "pp_LoopedBFS", "pp_InterleavedZeroBubble", "pp_ZBVZeroBubble"):
    LAYOUTS[_name] = (*LAYOUTS[_name][:4], [a for a in LAYOUTS[_name][4] if a != "hidden"])  # blocks split: refused
RESUMED = ("tp", "hsdp", "pp_1F1B", "fsdp_tp_coupled_centering")
MISSING_IN_TORCHTITAN = {"pp_ZBVZeroBubble": {"norm.weight"}}
"""Gradients stock torchtitan 0.3.0 itself may leave at None under a layout (its ZBV schedule
does not always compute the last stage's norm.weight gradient, with or without aniso_plugins)."""
STEP_ONE_ONLY = {"ep": "a mixture of experts routes each token to its top-k experts: the step-1 update's "
                       "float32 rounding, 5e-7 relative, moves some routings at step 2, as in stock torchtitan"}
"""Layouts compared at step 1 only (gradients and logged values), and why."""


def _copy_step(root: str, src: str, dst: str, step: int = 2):
    def prepare(done):
        target = os.path.join(root, dst, "checkpoint", f"step-{step}")
        shutil.copytree(os.path.join(root, src, "checkpoint", f"step-{step}"), target)
    return prepare


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict]:
    root = str(tmp_path_factory.mktemp("layouts"))
    assets = write_assets(os.path.join(root, "assets"), seq_len=SEQ, n_docs=N_DOCS, local_batch=2, worlds=(1, 2))
    assets["data_w4"] = os.path.join(root, "assets", "data_w4")
    write_dataset(assets["data_w4"], N_DOCS, SEQ, world=4, local_batch=1)
    seed = ["--checkpoint.initial_load_path", os.path.join(root, "seed", "checkpoint", "step-0")]
    moe_seed = ["--checkpoint.initial_load_path", os.path.join(root, "seed_moe", "checkpoint", "step-0")]

    def val(data: str) -> list[str]:  # validation batches laid out as the training ones: the same documents
        return ["--validator.dataloader.dataset_path", assets[data]]

    make_seed = ["--checkpoint.create_seed_checkpoint", "--training.steps", "1"]
    jobs = [
        dict(name="seed", config="cpu_stock", args=make_seed),
        dict(name="seed_moe", config="cpu_moe_stock", args=make_seed),
        dict(name="one_A", config="cpu_aniso", args=seed + COMMON + A + EVAL + val("data_w1"), after=["seed"], local=4),
        # one sequence per micro-batch: 4 validation batches of 1 are the layouts' batch of 4
        dict(name="one_A_ga4", config="cpu_aniso", args=seed + COMMON + A + EVAL + val("data_w1") + GA4
             + ["--validator.steps", "4"], after=["seed"], local=1),
        dict(name="one_B", config="cpu_aniso", args=seed + COMMON + B, after=["seed"], local=4),
        dict(name="one_C", config="cpu_aniso", args=seed + COMMON + C, after=["seed"], local=4),
        dict(name="one_D", config="cpu_aniso", args=seed + COMMON + D, after=["seed"], local=4),
        dict(name="one_D1", config="cpu_aniso", args=seed + COMMON + D + ["--training.steps", "1"], after=["seed"], local=4),
        dict(name="one_E", config="cpu_aniso", args=seed + COMMON + E, after=["seed"], local=4),
        dict(name="one_moe", config="cpu_moe_aniso", args=moe_seed + COMMON + A, after=["seed_moe"], local=4),
    ]
    for name, (ref, world, data, local, flags) in LAYOUTS.items():
        config, init = ("cpu_moe_aniso", moe_seed) if ref == "one_moe" else ("cpu_aniso", seed)
        jobs.append(dict(name=name, config=config, args=init + COMMON + flags + val(data), world=world, data=data,
                         local=local, after=[ref]))
    for name in RESUMED:  # resume the step-2 checkpoint of the layout's own run
        _, world, data, local, flags = LAYOUTS[name]
        jobs.append(dict(name=f"{name}_resumed", config="cpu_aniso", args=COMMON + flags + val(data), world=world, data=data,
                         local=local, after=[name], prepare=_copy_step(root, name, f"{name}_resumed")))
    return Launcher(root, assets, parallel=4).run_all(jobs)


def _close(got: torch.Tensor, want: torch.Tensor, rtol: float = 1e-5) -> bool:
    if got.shape != want.shape or want.numel() == 0:
        return torch.equal(got, want)
    return float((got.double() - want.double()).abs().max()) <= rtol * max(float(want.double().abs().max()), 1e-30)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_every_layout_trains_and_measures_like_one_rank(runs, name):
    run, ref = runs[name], runs[LAYOUTS[name][0]]
    for param, value in ref["params"].items():  # the seed checkpoint is the reference's initialization
        assert torch.equal(run["params"][param], value), param
    missing = MISSING_IN_TORCHTITAN.get(name, set())
    last = 1 if name in STEP_ONE_ONLY else 2
    for key in ("grads", "grads_step2")[:last]:
        assert set(ref[key]) - set(run[key]) <= missing, key
        bad = [p for p, g in ref[key].items() if p in run[key] and not _close(run[key][p], g)]
        assert bad == [], f"{key}: {bad}"
    for namespace, state in ref["aniso_state"].items():  # AGG's counter, the target counts, spectrum's c1 (counts
        # of tokens only: the same under every layout, also where routing changes the later steps)
        for key, value in state.items():
            assert _close(run["aniso_state"][namespace][key], value, 1e-9), (namespace, key)
    logged = [t for t in ref["tb"] if t.startswith(("aniso/", "validation_metrics/aniso/")) and t in run["tb"]]
    assert len(logged) > 10
    for tag in logged:
        for step, value in ref["tb"][tag].items():
            if name in STEP_ONE_ONLY and step > 1:
                continue
            got = run["tb"][tag][step]
            assert (math.isnan(value) and math.isnan(got)) or got == pytest.approx(value, rel=1e-5, abs=1e-9), (tag, step)
    assert set(ref["tb"]["aniso/geometry/head/mean_cosine"]) == set(range(1, STEPS + 1))


NOT_HELD = {name: ("aniso/geometry/embedding/", "aniso/hidden/") for name in LAYOUTS if name.startswith("pp_")}
"""What a layout's head stage does not hold, by tag prefix: under PP the embedding lives on the
first stage, and the blocks are split over the stages (hidden states refused)."""


def _logged(run: dict, prefixes: tuple[str, ...] = ("aniso/", "validation_metrics/aniso/")) -> set[str]:
    return {t for t in run["tb"] if t.startswith(prefixes)}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_the_layouts_log_every_metric_their_reference_logs(runs, name):
    """The comparison above reads the tags both runs logged: here each layout logs every training
    metric of its reference (the set of tags), less what it does not hold (`NOT_HELD`)."""
    ref = _logged(runs[LAYOUTS[name][0]], ("aniso/",))
    expected = {t for t in ref if not t.startswith(NOT_HELD.get(name, ()))}
    assert len(expected) > 10
    assert _logged(runs[name], ("aniso/",)) == expected


@pytest.mark.slow
@pytest.mark.parametrize("name, tag", [
    *[(n, f"aniso/hidden/layer_{layer}/mean_cosine") for n in ("tp", "fsdp_tp", "hsdp") for layer in (0, 1)],
    *[(n, "validation_metrics/aniso/eval/ppl") for n in ("tp", "pp_1F1B", "hsdp")],
    ("tp", "aniso/geometry/embedding/mean_cosine"),
])
def test_the_layouts_measure_what_they_hold(runs, name, tag):
    """The values each layout splits in its own way, equal to one rank's at every logged step:
    hidden states under TP with sequence parallelism (each rank holds a slice of the positions;
    they were NaN on torchtitan without gradient accumulation), evaluation under TP (vocabulary
    shards of the logits) and PP, the embedding under TP."""
    run, ref = runs[name]["tb"], runs[LAYOUTS[name][0]]["tb"]
    assert tag in run and set(run[tag]) == set(ref[tag]) and ref[tag], tag
    for step, value in ref[tag].items():
        assert math.isfinite(value) and run[tag][step] == pytest.approx(value, rel=1e-5, abs=1e-9), (tag, step)


@pytest.mark.slow
def test_coupled_adam_and_centering_follow_the_formula_in_torchtitan(runs):
    """Step 1 of one rank with Coupled Adam + μ-centering, from its recorded weights and gradient:
    m̂ = g and v̂ = g² at t = 1, so Coupled Adam moves the head by −lr·q, q = g / (√(mean_i g_i²) + ε)
    (one denominator per hidden dimension, shared by every row), and centring then subtracts the
    mean row: W1 − W0 + mean(W0) = −lr·(q − mean(q)) for one lr, and mean(W1) = 0."""
    run = runs["one_D1"]
    w0, g, w1 = (run[key]["lm_head.weight"].double() for key in ("params", "grads", "final_params"))
    q = g / (g.square().mean(0).sqrt() + 1e-8)
    moved, direction = w1 - w0 + w0.mean(0), q - q.mean(0)
    lr = float(-(moved * direction).sum() / direction.square().sum())
    assert lr > 0 and float((moved + lr * direction).abs().max()) <= 1e-5 * float(moved.abs().max())
    assert float(w1.mean(0).abs().max()) < 1e-7 * float(w1.abs().max())
    plain_adam = g / (g.abs() + 1e-8)  # AdamW's own step-1 direction: what an unhooked optimizer would have taken
    assert float((moved + lr * (plain_adam - plain_adam.mean(0))).abs().max()) > 0.1 * float(moved.abs().max())


@pytest.mark.slow
def test_the_remedies_final_weights_equal_one_rank(runs):
    """After the 4 steps, not only the step-2 gradients: every parameter of the sharded runs, to
    1e-5 absolute (AdamW's normalised step lifts the float32 rounding of another reduction order to
    ~3e-6 on the blocks, with the loss term alone too; a wrong vocabulary mean moves the head by ~lr)."""
    for name in ("fsdp_tp_coupled_centering", "tp_mu_loss"):
        run, ref = runs[name], runs[LAYOUTS[name][0]]
        for param, want in ref["final_params"].items():
            torch.testing.assert_close(run["final_params"][param], want, rtol=0, atol=1e-5, msg=f"{name}: {param}")


@pytest.mark.slow
@pytest.mark.parametrize("name", RESUMED)
def test_a_checkpoint_written_under_the_layout_resumes_exactly(runs, name):
    full, resumed = runs[name], runs[f"{name}_resumed"]
    assert "Training starts at step 3" in resumed["log"]
    for param, value in full["final_params"].items():
        assert torch.equal(resumed["final_params"][param], value), param
    for namespace, state in full["aniso_state"].items():
        for key, value in state.items():
            assert torch.equal(resumed["aniso_state"][namespace][key], value), (namespace, key)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tp", "hsdp"])
def test_aniso_report_reads_the_checkpoint_written_under_tp_and_hsdp(runs, name, tmp_path):
    assert_aniso_report_reads_the_last_checkpoint(runs[name], tmp_path)
