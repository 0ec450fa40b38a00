"""The HF Trainer on every distributed engine it offers (DDP, accelerate's FSDP1 and FSDP2,
DeepSpeed ZeRO-1/2/3 and ZeRO-3 with CPU offload), each on 2 gloo CPU processes against a
1-process run of the same global batch from the same weights: every logged ``aniso/...`` value
and the loss at every step, and every parameter after training.

The runs are real (tests/hf_engine_script.py under torch.distributed.run, accelerate's CPU shims
of tests/hf_engines.py). Each run also reports what the engine really did, so that no test
passes because accelerate fell back to DDP or ZeRO-3 left the tiny model gathered: ZeRO-3 holds
the head as a (0,) placeholder between steps, FSDP1 as a flat 1-D shard."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "hf_engine_script.py")

METRIC_RTOL = 2e-5
"""Logged values: float32 sums in another order over 2 ranks (the plain Trainer's own loss
differs by ~1e-7 between 1 and 2 processes)."""
WEIGHT_ATOL = 1e-5
"""Weights after 4 AdamW steps at lr 1e-2: the plain Trainer's 1-vs-2-process difference is ~2e-7,
Adam's normalised step can raise a float32 rounding difference to ~2e-6; a wrong gradient moves a
weight by up to the learning rate."""


def _env() -> dict[str, str]:
    return dict(
        os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", PYTHONUNBUFFERED="1",
        PYTHONPATH=os.pathsep.join([HERE, os.path.join(HERE, "..", "examples"), os.environ.get("PYTHONPATH", "")]),
    )


def run(out, engine: str, runs: str, *flags: str) -> subprocess.CompletedProcess:
    """The script on 2 processes (`engine`) or 1 (``"single"``); raises with its output on failure."""
    launcher = [sys.executable] if engine == "single" else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    cmd = [*launcher, SCRIPT, str(out), engine, runs, *flags]
    done = subprocess.run(cmd, env=_env(), timeout=600, capture_output=True, text=True)
    if done.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {done.returncode}:\n{done.stdout[-4000:]}\n{done.stderr[-8000:]}")
    return done


def result(out, name: str, suffix: str = "") -> tuple[dict, dict[str, torch.Tensor]]:
    """The record and the weights of run `name` (``[TRAINER:]CONFIG``) in `out`."""
    folder = os.path.join(out, name.replace(":", "_"))
    with open(os.path.join(folder, f"record{suffix}.json")) as f:
        record = json.load(f)
    return record, load_file(os.path.join(folder, f"weights{suffix}.safetensors"))


PER_RANK = frozenset({"aniso/uniformity/hidden"})
"""Metrics defined per rank (docs/metrics.md: uniformity of hidden states over pairs within a rank,
pooled): equal to a DDP run of the same ranks, not to one process."""


def assert_same_run(reference, other, steps=None, per_rank=None, loss_factor=1.0) -> None:
    """Equal loss (times `loss_factor`) and ``aniso/...`` values at every logged step (only
    `steps`, if given), and equal weights; the `PER_RANK` values against `per_rank` (a DDP run's
    record) instead."""
    (ref, ref_w), (got, got_w) = reference, other

    def key(row: dict) -> tuple[int, bool]:  # a training record, or the evaluation's at that step
        return row["step"], "eval_loss" in row

    by_step = {key(r): r for r in ref["records"]}
    ddp_by_step = {key(r): r for r in per_rank["records"]} if per_rank is not None else {}
    compared = [r for r in got["records"] if steps is None or r["step"] in steps]
    assert compared and {key(r) for r in compared} == {k for k in by_step if steps is None or k[0] in steps}
    for row in compared:
        expected = by_step[key(row)]
        assert set(row) == set(expected), set(row) ^ set(expected)
        for name, value in row.items():
            source = expected
            if name in PER_RANK:
                if per_rank is None:
                    continue
                source = ddp_by_step[key(row)]
            factor = loss_factor if name == "loss" else 1.0
            assert value == pytest.approx(factor * source[name], rel=METRIC_RTOL, abs=1e-7), (row["step"], name)
    assert set(got_w) == set(ref_w)
    for name, weight in ref_w.items():
        torch.testing.assert_close(got_w[name], weight, rtol=0, atol=WEIGHT_ATOL, msg=name)


def report_matrices(run_dir) -> dict:
    """The numbers of the report ``report_at_end`` wrote (rank 0, from the gathered weights)."""
    with open(os.path.join(run_dir, "run", "aniso_report", "report.json")) as f:
        (model,) = json.load(f)["models"]
    return {f"{name}/{k}": v for name, m in model["matrices"].items() for k, v in m.items() if isinstance(v, (int, float))}


def assert_engine(record: dict, engine: str) -> None:
    """The engine ran as asked, and partitioned the head where it partitions parameters."""
    facts = record["engine"]
    assert record["world"] == 2
    if engine.startswith("fsdp"):
        assert facts["fsdp"] and not facts["deepspeed"]
    if engine.startswith("fsdp1"):
        assert facts["wrapper"] == "FullyShardedDataParallel"
        assert all(len(shape) != 2 for shape in facts["head_shapes_between_steps"])  # flat shards
    if engine.startswith("zero"):
        assert facts["deepspeed"] and facts["zero_stage"] == int(engine[4])
    if engine.startswith("zero3"):
        assert all(shape == [0] for shape in facts["head_shapes_between_steps"])  # placeholders: partitioned
    if engine == "ddp":
        assert facts["wrapper"] == "DistributedDataParallel"


MAIN = "agg"
"""AGG (on the fused loss) + geometry + frequency: the issue's failing case."""
RUNS = (MAIN, "cosreg", "lowrank", "agg_untied", "activations", "seq2seq:agg", "seq2seq:cosreg", "sft:agg", "sft:cosreg")
"""Every method and metric: AGG; a regularizer in the loss graph; the low-rank and untied heads;
SimCTG and uniformity with the hidden-state, bottleneck, uniformity, under-trained and
evaluation metrics and the report written at the end of training; and `Seq2SeqTrainer` (a
Marian model: the decoder's head, the decoder labels as they are) and TRL's `SFTTrainer` (its
fused LM head routed through the model's head) with AGG and CosReg."""
ENGINES = ("ddp", "fsdp2", "fsdp1", "fsdp1_flat", "zero1", "zero2", "zero3", "zero3_offload")


def loss_factor(run_name: str, world: int) -> float:
    """Marian's loss is its micro-batch mean, which the Trainer multiplies by the number of
    processes (it takes it as divided by the global target count): it logs `world` × the loss."""
    return float(world) if run_name.startswith("seq2seq:") else 1.0


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("single")
    run(out, "single", ",".join(RUNS))
    return out


@pytest.fixture(scope="module")
def ddp(tmp_path_factory):
    """DDP: the reference of the metrics defined per rank, and the first engine tested."""
    out = tmp_path_factory.mktemp("ddp")
    run(out, "ddp", ",".join(RUNS), "--save", "2")
    return out


@pytest.mark.slow
@pytest.mark.parametrize("engine", ENGINES)
def test_every_method_and_metric_equals_one_process_and_resumes(tmp_path, reference, ddp, engine):
    """Every run of `RUNS` on `engine` against its 1-process reference; then AGG + metrics resumed
    from step 2 (the engine's own checkpoint and aniso_state.safetensors) against the
    uninterrupted run at steps 3 and 4. ZeRO-3 and FSDP1 hold the head partitioned between steps;
    before, their first measurement crashed (``head weight must be a 2-D floating-point (V, d)
    tensor, got shape (0,)``). FSDP1 resumes in `test_fsdp1_resumes` (its AdamW state).
    accelerate cannot wrap this Marian model at all (without aniso_plugins too) under FSDP2 (its
    encoder's and decoder's shared embedding land in two FSDP groups: "Parameter
    'model.encoder.embed_tokens.weight' is shared with a parameter already managed by another
    FSDP group") nor under FSDP1 with flat parameters (its sinusoidal positions are frozen beside
    trained weights: "Must flatten tensors with uniform `requires_grad`"): those two engines run
    no `Seq2SeqTrainer` case."""
    runs = [name for name in RUNS if not (engine in ("fsdp2", "fsdp1_flat") and name.startswith("seq2seq:"))]
    out = ddp
    if engine != "ddp":
        out = tmp_path
        run(out, engine, ",".join(runs), *(() if engine.startswith("fsdp1") else ("--save", "2")))
    for name in runs:
        got = result(out, name)
        assert_engine(got[0], engine)
        per_rank = result(ddp, name)[0] if name == "activations" else None
        assert_same_run(result(reference, name), got, per_rank=per_rank, loss_factor=loss_factor(name, 2))
    report, expected_report = (report_matrices(folder / "activations") for folder in (out, reference))
    assert report["embedding/rows"] == 64 and report == pytest.approx(expected_report, rel=1e-4, abs=1e-6)
    if not engine.startswith("fsdp1"):
        run(out, engine, MAIN, "--resume", "2")
        assert_same_run(result(out, MAIN), result(out, MAIN, "_resumed2"), steps={3, 4})


@pytest.mark.slow
def test_agg_over_ranks_and_micro_batches_equals_the_step_as_one_batch(tmp_path, ddp):
    """DDP's 2 ranks × 2 micro-batches of 2 sequences train AGG exactly as one process with the
    step's 8 sequences in one batch (AGG counts the whole step before its first forward; before,
    a step was gated micro-batch by micro-batch, and only a split over ranks was exact)."""
    run(tmp_path, "single", MAIN, "--accumulation", "1")
    assert_same_run(result(tmp_path, MAIN), result(ddp, MAIN))


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["fsdp1", "fsdp1_flat"])
def test_fsdp1_resumes(tmp_path, engine):
    """FSDP1's AdamW state does not reload exactly through accelerate on CPU, without
    aniso_plugins too (the plain Trainer's step-4 loss 4.0603 uninterrupted, 4.0709 resumed). With
    SGD, which has no state, the plain Trainer resumes exactly, and so does AGG + metrics."""
    run(tmp_path, engine, MAIN, "--save", "2", "--optim", "sgd")
    run(tmp_path, engine, MAIN, "--resume", "2", "--optim", "sgd")
    assert_same_run(result(tmp_path, MAIN), result(tmp_path, MAIN, "_resumed2"), steps={3, 4})


@pytest.mark.slow
def test_loss_terms_keep_their_share_under_deepspeed_fp16(tmp_path, reference):
    """DeepSpeed's fp16 scales the loss in its own ``backward`` (accelerate holds no scaler for
    it): CosReg's term is scaled alike, so the step it adds equals the fp32 1-process run's (SGD:
    the weights move by lr · λ∇R more than without it; fp16 weights: 3% here). Before, the term
    was 1/128 of its share (DeepSpeed's static loss scale 128 unscaled it)."""
    run(tmp_path / "single", "single", "none,cosreg", "--optim", "sgd")
    run(tmp_path / "fp16", "zero2_fp16", "none,cosreg", "--optim", "sgd")
    name = "model.embed_tokens.weight"  # tied to the head: CosReg's gradient lands here
    expected = result(tmp_path / "single", "cosreg")[1][name].double() - result(tmp_path / "single", "none")[1][name].double()
    got = result(tmp_path / "fp16", "cosreg")[1][name].double() - result(tmp_path / "fp16", "none")[1][name].double()
    assert expected.norm() > 1e-3
    assert (got - expected).norm() / expected.norm() < 0.1


@pytest.mark.slow
def test_zero3_model_loaded_partitioned(tmp_path, reference):
    """A model loaded after ``TrainingArguments(deepspeed=...)`` (``from_pretrained``, as users
    load one) is partitioned from the start (transformers builds it under
    ``deepspeed.zero.Init``): set-up finds the head and reads V and d from ZeRO's ``ds_shape``,
    and the untied head is copied from the gathered weight. Before, set-up refused the model
    ("LlamaForCausalLM has no module that makes its logits: ... 'lm_head' (Linear, weight None)")."""
    run(tmp_path, "zero3", "agg_untied", "--model", "llama_pretrained")
    got = result(tmp_path, "agg_untied")
    assert_engine(got[0], "zero3")
    assert_same_run(result(reference, "agg_untied"), got)


REMEDIES = ("coupled_centering", "mu_loss")
"""Coupled Adam with μ-centering (the optimizer's update and the step-end centring of the head's
rows) and μ-loss (a loss term), each with the geometry metrics."""


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["ddp", "fsdp2"])
def test_the_optimizer_side_remedies_equal_one_process_and_resume(tmp_path, engine):
    """FSDP2 holds the head as row shards: Coupled Adam's vocabulary mean of v and μ-centering's
    mean row are sums over the shards, equal to one process's; resumed from step 2 (Coupled
    Adam's state in the engine's optimizer checkpoint), steps 3 and 4 are the uninterrupted run's."""
    run(tmp_path / "single", "single", ",".join(REMEDIES))
    out = tmp_path / engine
    run(out, engine, ",".join(REMEDIES), "--save", "2")
    for name in REMEDIES:
        got = result(out, name)
        assert_engine(got[0], engine)
        assert_same_run(result(tmp_path / "single", name), got)
    run(out, engine, "coupled_centering", "--resume", "2")
    assert_same_run(result(out, "coupled_centering"), result(out, "coupled_centering", "_resumed2"), steps={3, 4})


@pytest.mark.slow
def test_the_optimizer_side_remedies_are_refused_under_fsdp1(tmp_path):
    with pytest.raises(AssertionError, match="FSDP1 flattens the parameters into buffers sharded by elements"):
        run(tmp_path, "fsdp1", "coupled_centering")
    assert not (tmp_path / "coupled_centering" / "record.json").exists()


@pytest.mark.parametrize("engine", ["deepspeed", "fsdp1", "fsdp2", None])
def test_which_engines_step_flat_buffers(engine):
    """`optimizer_flat`, the rule that refuses Coupled Adam and μ-centering at construction."""
    from types import SimpleNamespace

    from aniso_plugins.integrations.hf.layout import optimizer_flat

    plugin = SimpleNamespace(fsdp_version=int(engine[-1])) if engine in ("fsdp1", "fsdp2") else None
    trainer = SimpleNamespace(is_deepspeed_enabled=engine == "deepspeed", is_fsdp_enabled=plugin is not None,
                              accelerator=SimpleNamespace(state=SimpleNamespace(fsdp_plugin=plugin)))
    why = optimizer_flat(trainer)
    assert (why is None) == (engine in ("fsdp2", None))
    if why is not None:
        assert ("DeepSpeed" if engine == "deepspeed" else "FSDP1") in why and "fsdp_version': 2" in why


@pytest.mark.parametrize(
    ("parallelism", "fsdp_strategy", "message"),
    [
        ({"tp_size": 2}, None, "tensor parallelism through the Trainer"),
        ({"cp_size": 2}, None, "context parallelism"),
        ({"sp_size": 2}, None, "sequence parallelism"),
        ({"dp_replicate_size": 2, "dp_shard_size": 2}, None, "hybrid sharding"),
        ({}, "HYBRID_SHARD", "hybrid sharding"),
    ],
)
def test_layouts_the_trainer_cannot_serve_are_refused_at_construction(parallelism, fsdp_strategy, message):
    """The rule `AnisoCallback` applies in ``Trainer(...)`` (before anything changes the model),
    on the attributes it reads: these layouts need 4 or more ranks or GPUs to run at all."""
    from types import SimpleNamespace

    from hf_utils import tiny_llama
    from torch.distributed.fsdp import ShardingStrategy

    from aniso_plugins.integrations.hf.layout import refusal as refusal_of

    plugin = SimpleNamespace(reshard_after_forward=getattr(ShardingStrategy, fsdp_strategy)) if fsdp_strategy else None
    trainer = SimpleNamespace(
        args=SimpleNamespace(parallelism_config=SimpleNamespace(**parallelism)), model=tiny_llama(),
        is_fsdp_enabled=plugin is not None, accelerator=SimpleNamespace(state=SimpleNamespace(fsdp_plugin=plugin)),
    )
    refusal = refusal_of(trainer)
    assert refusal is not None and message in refusal
    plain = SimpleNamespace(args=SimpleNamespace(parallelism_config=None), model=tiny_llama(), is_fsdp_enabled=False)
    assert refusal_of(plain) is None
