"""Model zoo: every method through the REAL transformers Trainer (Seq2SeqTrainer for some
encoder-decoders) on tiny random models of many architectures, and the Trainer features that
change how the head's input, output and gradients come about.

Per cell (one optimizer step, logging every step, geometry metrics on):

a. the first training forward equals a run of the same model / seed / data without the
   callback (the LM head's output, bit for bit); for the low-rank head, the head output against
   an independent float64 truncated SVD of the original head weight;
b. the gradient of the head right before the first optimizer step (clipping off) equals a float64
   reference written out here from the formulas (tests/zoo.py; no aniso_plugins code): the
   cross-entropy through the model's own post-head transform (Gemma2's soft-cap, Bart / Marian /
   Pegasus' final_logits_bias, Phi's head bias) with the model's own label alignment (causal:
   position t predicts labels[t + 1]; masked LM and the decoder of an encoder-decoder: the labels
   as they are), normalized by the number of valid targets of the step; AGG gates at step 1 from
   the counts of the step's targets; CosReg adds reg_weight·∇R; the low-rank head's A and B;
   SimCTG the gradient reaching the head's input. For a tied head the input-lookup part is
   taken from the run without the callback (only the output-side part is replaced);
c. ``aniso/...`` metrics are in ``trainer.state.log_history``.

Every run also checks its reference against what the Trainer really did where the method does
not change it (the head's output and the gradient reaching it), so a failing cell means the
library differs from the formula, not that the reference misread the model.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from collections.abc import Callable

import pytest
import torch
from transformers import (
    DataCollatorWithFlattening,
    Seq2SeqTrainer,
    Seq2SeqTrainingArguments,
    Trainer,
    TrainingArguments,
    default_data_collator,
)

from aniso_plugins import AnisoConfig, ConfigError, SetupError
from aniso_plugins.integrations.hf import AnisoCallback

import zoo
from zoo import ARCHS, BATCH, IGNORE, VOCAB

ALPHA = 2.5  # at step 1, a_k = count of k in the step's targets: ids seen 0, 1, 2 times are rare; g1 = a_k (0, 1, 2) and g2 = min(a_k/ā, 1) differ, so the gates depend on each row's own target
WINDOW = 4
REG_WEIGHT = 5.0  # large enough that the term stands out of T5's O(1)-norm embedding gradient
RANK = 8  # < d = 16
SIMCTG_MARGIN = 1.0  # pairs with cos > 0 cost something: about half of them at random init
SIMCTG_WEIGHT = 1.0
METRICS = ("geometry",)
QUIET = dict(
    report_to="none", use_cpu=True, disable_tqdm=True, save_strategy="no", seed=0, data_seed=0,
    per_device_train_batch_size=BATCH, max_steps=1, learning_rate=1e-2, max_grad_norm=0.0, logging_steps=1,
    dataloader_num_workers=0,
)


def method_config(method: str, **extra) -> AnisoConfig:
    common = dict(metrics=METRICS, load_entry_points=False, **extra)
    return {
        "none": lambda: AnisoConfig(method="none", **common),
        "agg": lambda: AnisoConfig(method="agg", alpha=ALPHA, window=WINDOW, **common),
        "cosreg": lambda: AnisoConfig(method="cosreg", reg_weight=REG_WEIGHT, **common),
        "lowrank": lambda: AnisoConfig(head="lowrank", lowrank_rank=RANK, lowrank_init="svd", **common),
        "simctg": lambda: AnisoConfig(method="simctg", simctg_weight=SIMCTG_WEIGHT, simctg_margin=SIMCTG_MARGIN, **common),
        "fused": lambda: AnisoConfig(method="none", fused_loss=True, **common),
        "agg_gated": lambda: AnisoConfig(method="agg", alpha=ALPHA, window=WINDOW, fused_loss=False, **common),
    }[method]()


# --- running the Trainer ---------------------------------------------------------------------
@dataclasses.dataclass
class Run:
    trainer: Trainer
    model: torch.nn.Module
    rec: zoo.Recorder | None
    w_before: torch.Tensor  # the trainable head's weight before Trainer(...) (before any surgery)
    b_before: torch.Tensor | None
    start: dict[str, torch.Tensor]  # the trainable head's parameters after Trainer(...), before training
    callback: AnisoCallback | None

    @property
    def mbs(self) -> list[zoo.MicroBatch]:
        return self.rec.mbs

    @property
    def grads(self) -> dict[str, torch.Tensor]:
        assert self.rec.grads is not None, "no optimizer step was recorded"
        return self.rec.grads


def train(arch: zoo.Arch, out_dir, config: AnisoConfig | None = None, *, model=None, data=None, collator=None,
          seq2seq: bool | None = None, record: bool = True, lookups: bool = False, resume=None, **args) -> Run:
    model = arch.build() if model is None else model
    head = zoo.trainable_head(model)
    w_before = head.weight.detach().clone()
    b_before = head.bias.detach().clone() if getattr(head, "bias", None) is not None else None
    seq2seq = arch.seq2seq_trainer if seq2seq is None else seq2seq
    collate = zoo.RecordingCollator(collator or default_data_collator)
    callback = AnisoCallback(config) if config is not None else None
    args_cls, trainer_cls = (Seq2SeqTrainingArguments, Seq2SeqTrainer) if seq2seq else (TrainingArguments, Trainer)
    trainer = trainer_cls(
        model=model, args=args_cls(output_dir=str(out_dir), **{**QUIET, **args}),
        train_dataset=arch.data() if data is None else data, data_collator=collate,
        callbacks=[callback] if callback is not None else [],
    )
    head = zoo.trainable_head(trainer.model)
    params = {n: p for n, p in head.named_parameters() if p.requires_grad}
    start = {n: p.detach().clone() for n, p in params.items()}
    rec = zoo.Recorder(trainer, collate, params, lookups=lookups) if record else None
    trainer.train(resume_from_checkpoint=resume)
    return Run(trainer, trainer.model, rec, w_before, b_before, start, callback)


_BASELINES: dict[tuple, Run] = {}


def baseline(arch_name: str, variant: str, tmp_factory, make: Callable[[], Run]) -> Run:
    """The run without the callback, shared by the cells of one architecture / feature; its
    reference self-check runs once (a failure there is a test bug, not a library bug)."""
    key = (arch_name, variant)
    if key not in _BASELINES:
        run = make(tmp_factory.mktemp(f"base-{arch_name}-{variant}"))
        _BASELINES[key] = run
    return _BASELINES[key]


# --- references -------------------------------------------------------------------------------
def step_targets(arch: zoo.Arch, run: Run) -> list[torch.Tensor]:
    return [zoo.targets_for(arch.kind, mb.batch["labels"]) for mb in run.mbs]


def post_of(arch: zoo.Arch, run: Run):
    return lambda z: arch.post(run.model, z)


def output_side(arch, run, mode="plain", *, smoothing=0.0, targets=None, gate_targets=None, lowrank=None):
    """Σ over the step's micro-batches of the reference head gradients (float64), with the
    Trainer's normalisation: Σ CE / (valid targets of the whole step). mode "agg": every
    micro-batch gated with the counts of the whole step (step 1, a_k = counts; the step's
    micro-batches are counted before its first forward). `gate_targets` (for a diagnosis only):
    compute the gates from other targets than the loss's."""
    targets = step_targets(arch, run) if targets is None else targets
    gate_targets = targets if gate_targets is None else gate_targets
    normalizer = sum(int((t != IGNORE).sum()) for t in targets)
    counts = sum(torch.bincount(gt[gt != IGNORE].reshape(-1), minlength=VOCAB) for gt in gate_targets)
    total: dict[str, torch.Tensor] = {}
    parts = []
    for mb, tg, gt in zip(run.mbs, targets, gate_targets):
        gate = None
        if mode == "agg":
            gate = zoo.agg_gates(gt, counts, ALPHA)
        r = zoo.head_reference(mb.x, run.start.get("weight", run.w_before), run.start.get("bias"), tg, post_of(arch, run),
                               normalizer, gate=gate, smoothing=smoothing, lowrank=lowrank)
        parts.append(r)
        for k in ("dW", "dA", "dB", "db"):
            if r.get(k) is not None:
                total[k] = total[k] + r[k] if k in total else r[k]
    total["parts"] = parts
    total["normalizer"] = normalizer
    return total


def simctg_input_grad(run, targets, parts, *, segments=None, valid_targets=None):
    """Per micro-batch: ∂CE/∂h (the reference's) + weight · ∂L_CL/∂h / A (the step's term is the
    mean of its micro-batches' L_CL), from the O(T²) loop."""
    valid_targets = targets if valid_targets is None else valid_targets
    out = []
    for m, (mb, r) in enumerate(zip(run.mbs, parts)):
        h = mb.x.detach().double().requires_grad_(True)
        seg = None if segments is None else segments[m]
        loss = zoo.simctg_reference(h, valid_targets[m] != IGNORE, SIMCTG_MARGIN, seg)
        (g,) = torch.autograd.grad(loss, h)
        out.append((r["dx"], SIMCTG_WEIGHT * g / len(run.mbs)))
    return out


def err(got, ref) -> float:
    return float((got.double() - ref.double()).abs().max())


def assert_close(got, ref, what, rtol=1e-4, alternatives=None, relative_norm=False):
    """max |got − ref| <= rtol · max |ref| (or, `relative_norm`, ‖got − ref‖_F <= rtol·‖ref‖_F);
    on failure the message also gives the distance to each `alternatives` reference (a diagnosis)."""
    got, ref = got.double(), ref.double()
    assert got.shape == ref.shape, f"{what}: shape {tuple(got.shape)} != reference {tuple(ref.shape)}"
    if relative_norm:
        e, s, kind = float((got - ref).norm()), float(ref.norm()), "‖·‖_F"
    else:
        e, s, kind = err(got, ref), float(ref.abs().max()), "max|·|"
    if e <= rtol * s + 1e-12:
        return
    msg = f"{what}: {kind}(got − ref) = {e:.3e} > {rtol:g} · {kind}(ref) = {rtol * s:.3e}"
    for name, alt in (alternatives or {}).items():
        a = alt()
        ae = float((got - a.double()).norm()) if relative_norm else err(got, a)
        msg += f"\n    distance to the reference {name}: {ae:.3e}"
    raise AssertionError(msg)


def assert_distinct(a, b, tol_scale, what, factor=20.0, relative_norm=False):
    """The method's reference differs from the alternative (plain) one by far more than the
    tolerance, so a pass is meaningful. `tol_scale` is the absolute tolerance of the check
    (max-abs, or with `relative_norm` the tolerance as a fraction of ‖a‖_F)."""
    if relative_norm:
        d = float((a.double() - b.double()).norm() / a.double().norm())
        factor = 5.0  # bf16: the tolerance is already 4x the rounding seen
    else:
        d = err(a, b)
    assert d > factor * tol_scale, f"{what}: the method's reference is too close to the alternative ({d:.2e})"


def fused(run) -> bool:
    """Whether the run's head returned the fused loss (a 0-dim tensor) instead of logits."""
    return run.mbs[0].z is not None and run.mbs[0].z.dim() == 0


def check_loss(run, ref, rtol=1e-5, what="run"):
    """The loss the Trainer trained on (``training_step``'s return, summed over the step's
    micro-batches) equals the float64 reference Σ CE / (the step's valid targets)."""
    assert len(run.rec.losses) == len(run.mbs), f"{what}: {len(run.rec.losses)} losses for {len(run.mbs)} micro-batches"
    got, want = sum(run.rec.losses), float(sum(p["loss"] for p in ref["parts"]))
    assert abs(got - want) <= rtol * abs(want), f"{what}: the Trainer's loss {got!r} != the float64 reference {want!r}"


def check_reference_matches_trainer(arch, run, ref, rtol=1e-4, what="run"):
    """Self-check of the reference against the Trainer's own computation (not a library check
    when the method leaves the loss alone): the head's output, the gradient reaching it; with
    the fused loss (no logits), the gradient reaching the head's input."""
    for m, (mb, r) in enumerate(zip(run.mbs, ref["parts"])):
        if fused(run):
            assert mb.gx is not None, f"{what}: the gradient at the head input was not captured"
            assert_close(mb.gx, r["dx"], f"{what} micro-batch {m}: gradient at the head input vs reference CE", rtol=rtol)
            continue
        assert mb.z is not None and mb.gz is not None, f"{what}: the LM head's output / its gradient was not captured"
        assert_close(mb.z, r["z"], f"{what} micro-batch {m}: head output vs x·Wᵀ + b", rtol=1e-5 if rtol < 1e-3 else rtol)
        assert_close(mb.gz, r["dz"], f"{what} micro-batch {m}: gradient at the head output vs reference CE", rtol=rtol)


def check_logged(run, *extra_keys):
    keys = {k for record in run.trainer.state.log_history for k in record if k.startswith("aniso/")}
    assert any(k.startswith("aniso/geometry/") for k in keys), f"no aniso/geometry/... in log_history: {sorted(keys)}"
    for k in extra_keys:
        assert k in keys, f"{k} not in log_history ({sorted(keys)})"


def check_forward_identical(run, base, what="first training forward"):
    x, z, bx, bz = run.mbs[0].x, run.mbs[0].z, base.mbs[0].x, base.mbs[0].z
    assert torch.equal(x, bx), f"{what}: the head's input differs from the run without the callback (max {err(x, bx):.3e})"
    if not fused(run):  # the fused head returns the loss, not logits
        assert torch.equal(z, bz), f"{what}: the head's output differs from the run without the callback (max {err(z, bz):.3e})"


def shifted(labels_list):
    return [zoo.causal_shift(t) for t in labels_list]


# --- the architecture × method matrix ---------------------------------------------------------
@pytest.fixture(scope="session")
def zoo_tmp(tmp_path_factory):
    return tmp_path_factory


def arch_baseline(arch_name, zoo_tmp):
    arch = ARCHS[arch_name]

    def make(out):
        run = train(arch, out)
        model_head, emb = zoo.head_of(run.model), run.model.get_input_embeddings()
        assert (model_head.weight is emb.weight) == arch.tied, f"{arch_name}: tied={arch.tied} expected"
        ref = output_side(arch, run)
        check_reference_matches_trainer(arch, run, ref, what=f"{arch_name} baseline (reference self-check)")
        assert_close(run.mbs[0].gx, ref["parts"][0]["dx"], f"{arch_name} baseline: gradient at the head input (self-check)")
        if not arch.tied:
            assert_close(run.grads["weight"], ref["dW"], f"{arch_name} baseline: head weight gradient (self-check)")
        if arch.post is not zoo._identity:  # the post-head transform must matter for the reference
            plain = zoo.head_reference(run.mbs[0].x, run.start["weight"], run.start.get("bias"), step_targets(arch, run)[0],
                                       lambda z: z, ref["normalizer"])
            assert_distinct(plain["dz"], ref["parts"][0]["dz"], 1e-4 * float(ref["parts"][0]["dz"].abs().max()),
                            f"{arch_name}: post-head transform")
        return run

    return baseline(arch_name, "plain", zoo_tmp, make)


def check_method(arch, method, run, base, *, tied=None, alt_targets=None, segments=None,
                 alt_segments=False, smoothing=0.0, rtol=1e-4, relative_norm=False, forward=True):
    """Checks (a) and (b) for `method` on `run`, against `base` (the run without the callback)."""
    tied = arch.tied if tied is None else tied
    targets = step_targets(arch, run)
    if method == "lowrank":
        check_lowrank(arch, run, base, targets)
        return
    if method in ("agg", "fused"):  # the default: AGG fused where the model's loss is reproduced exactly
        assert fused(run) == arch.fused, f"{arch.name}/{method}: fused loss {fused(run)}, expected {arch.fused}"
    if forward:
        check_forward_identical(run, base)
    gated = method in ("agg", "agg_gated")
    ref = output_side(arch, run, "agg" if gated else "plain", smoothing=smoothing)
    check_reference_matches_trainer(arch, run, ref, rtol=rtol if not relative_norm else 5e-2, what=f"{arch.name}/{method}")
    check_loss(run, ref, rtol=1e-5 if not relative_norm else 1e-2, what=f"{arch.name}/{method}")
    plain = output_side(arch, run, smoothing=smoothing) if gated else ref
    if tied:
        base_plain = output_side(arch, base, smoothing=smoothing)
        lookup = base.grads["weight"].double() - base_plain["dW"]
    else:
        lookup = torch.zeros_like(ref["dW"])
    expected = lookup + ref["dW"]
    alternatives = {}
    if gated:
        assert_distinct(lookup + ref["dW"], lookup + plain["dW"], rtol if relative_norm else rtol * float(expected.abs().max()),
                        f"{arch.name}: AGG gating", relative_norm=relative_norm)
        if alt_targets is not None:  # diagnosis: gates from other (e.g. causally shifted) targets
            alt_dW = output_side(arch, run, "agg", smoothing=smoothing, gate_targets=alt_targets)["dW"]
            assert_distinct(ref["dW"], alt_dW, rtol * float(expected.abs().max()),
                            f"{arch.name}: AGG gates from the right vs causally shifted targets")
            alternatives["with AGG gates from causally shifted targets"] = lambda: lookup + alt_dW
        alternatives["without gating (plain CE)"] = lambda: lookup + plain["dW"]
    if method == "cosreg":
        term = REG_WEIGHT * zoo.cosreg_grad(run.start["weight"])
        assert_distinct(expected + term, expected, rtol * float(expected.abs().max()), f"{arch.name}: CosReg term")
        alternatives["without the CosReg term"] = lambda: expected
        expected = expected + term
    if method == "simctg":
        pairs = simctg_input_grad(run, targets, ref["parts"], segments=segments)
        for m, (mb, (dce, dcl)) in enumerate(zip(run.mbs, pairs)):
            assert_distinct(dce + dcl, dce, rtol * float(dce.abs().max()), f"{arch.name}: SimCTG term")
            alts = {"without the SimCTG term": lambda dce=dce: dce}
            if alt_targets is not None:
                alt = dce + simctg_input_grad(run, targets, ref["parts"], segments=segments, valid_targets=alt_targets)[m][1]
                assert_distinct(dce + dcl, alt, rtol * float(dce.abs().max()),
                                f"{arch.name}: SimCTG on the right vs causally shifted targets' positions")
                alts["SimCTG over causally shifted targets' positions"] = lambda alt=alt: alt
            if alt_segments:
                alt = dce + simctg_input_grad(run, targets, ref["parts"])[m][1]
                assert_distinct(dce + dcl, alt, rtol * float(dce.abs().max()),
                                f"{arch.name}: SimCTG pairs within vs across packed examples")
                alts["SimCTG with pairs across the packed examples"] = lambda alt=alt: alt
            assert mb.gx is not None, "the gradient at the head input was not captured"
            assert_close(mb.gx, dce + dcl, f"{arch.name}/simctg micro-batch {m}: gradient at the LM head's input",
                         rtol=rtol, alternatives=alts, relative_norm=relative_norm)
        if tied:  # the trunk's gradient changed, so the lookup part of a tied head did too
            return
    assert_close(run.grads["weight"], expected, f"{arch.name}/{method}: head weight gradient", rtol=rtol,
                 alternatives=alternatives, relative_norm=relative_norm)
    if "bias" in run.grads:
        assert_close(run.grads["bias"], ref["db"], f"{arch.name}/{method}: head bias gradient (never gated)", rtol=rtol,
                     relative_norm=relative_norm)


def check_lowrank(arch, run, base, targets):
    head = zoo.trainable_head(run.model)
    assert set(run.start) >= {"A", "B"}, f"low-rank head: expected parameters A and B, got {sorted(run.start)}"
    A_ref, B_ref = zoo.truncated_svd_factors(run.w_before, RANK)
    # singular vectors are unique up to a sign per component: align ours with the head's
    sign = torch.sign((A_ref * run.start["A"].double()).sum(0))
    A_ref, B_ref = A_ref * sign, B_ref * sign[:, None]
    assert_close(run.start["A"], A_ref, "low-rank init A = U_r S_r^½", rtol=1e-5)
    assert_close(run.start["B"], B_ref, "low-rank init B = S_r^½ V_rᵀ", rtol=1e-5)
    if run.b_before is not None:
        assert torch.equal(run.start["bias"], run.b_before), "low-rank head: bias not kept"
    # (a) the trunk is unchanged; the head's output is x·(U_r S_r V_rᵀ)ᵀ + b
    assert torch.equal(run.mbs[0].x, base.mbs[0].x), "low-rank: the head's input differs from the run without it"
    ref = output_side(arch, run, lowrank=(A_ref, B_ref))
    for m, (mb, r) in enumerate(zip(run.mbs, ref["parts"])):
        assert_close(mb.z, r["z"], f"low-rank micro-batch {m}: head output vs float64 truncated-SVD reference", rtol=1e-5)
        assert_close(mb.gz, r["dz"], f"low-rank micro-batch {m}: gradient at the head output vs reference CE")
    # (b) gradients of A and B (and the bias)
    assert_close(run.grads["A"], ref["dA"], "low-rank: gradient of A")
    assert_close(run.grads["B"], ref["dB"], "low-rank: gradient of B")
    if "bias" in run.grads:
        assert_close(run.grads["bias"], ref["db"], "low-rank: gradient of the bias")
    assert tuple(head.A.shape) == (VOCAB, RANK) and tuple(head.B.shape) == (RANK, run.w_before.shape[1])


METHODS = ["none", "agg", "agg_gated", "fused", "cosreg", "lowrank", "simctg"]


CELLS = [(a, m) for a in ARCHS for m in METHODS if m != "agg_gated" or ARCHS[a].fused]
"""agg_gated (AGG with fused_loss=False) only where AGG is fused by default: elsewhere the 'agg' cell is it."""


@pytest.mark.parametrize("arch_name,method", CELLS)
def test_architecture_method(arch_name, method, tmp_path, zoo_tmp):
    arch = ARCHS[arch_name]
    if method == "fused" and not arch.fused:  # its loss is not ForCausalLMLoss of the head's output
        with pytest.raises(ConfigError, match=f"fused_loss=True: {type(arch.build()).__name__}"):
            train(arch, tmp_path, method_config(method), record=False)
        return
    base = arch_baseline(arch_name, zoo_tmp)
    run = train(arch, tmp_path, method_config(method))
    alt = shifted([mb.batch["labels"] for mb in run.mbs]) if arch.kind != "causal" else None
    check_method(arch, method, run, base, alt_targets=alt)
    extra = {"cosreg": ("aniso/loss/cosreg",), "simctg": ("aniso/loss/simctg",)}.get(method, ())
    check_logged(run, *extra)


# --- Trainer features (GPT-2: tied, Llama: untied) ---------------------------------------------
FEATURE_ARCHS = ["gpt2", "llama_untied"]
LORA_TARGETS = {"gpt2": ["c_attn"], "llama_untied": ["q_proj", "v_proj"]}


def lora_model(arch_name, modules_to_save=("lm_head",)):
    from peft import LoraConfig, get_peft_model

    cfg = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=LORA_TARGETS[arch_name],
                     modules_to_save=list(modules_to_save) if modules_to_save else None)
    return get_peft_model(ARCHS[arch_name].build(), cfg)


FEATURES: dict[str, dict] = {
    "grad_accum": dict(method="agg", args=dict(gradient_accumulation_steps=2, per_device_train_batch_size=2)),
    "grad_checkpointing": dict(method="agg", args=dict(gradient_checkpointing=True)),
    "bf16": dict(method="agg", args=dict(bf16=True)),
    "torch_compile": dict(method="agg", args=dict(torch_compile=True)),
    "peft_lora": dict(method="agg", model=lambda name: lora_model(name)),
    "flattening_simctg": dict(method="simctg", data=lambda: zoo.VarLenData(),
                              collator=lambda: DataCollatorWithFlattening()),
    "padding_agg": dict(method="agg", data=lambda: zoo.VarLenData(), collator=lambda: zoo.pad_collator(0)),
    "padding_simctg": dict(method="simctg", data=lambda: zoo.VarLenData(), collator=lambda: zoo.pad_collator(0)),
    "label_smoothing": dict(method="agg", args=dict(label_smoothing_factor=0.1)),
    "neftune": dict(method="agg", args=dict(neftune_noise_alpha=5.0)),
}


def feature_run(arch_name, feature, out, config):
    spec = FEATURES[feature]
    arch = ARCHS[arch_name]
    return train(
        arch, out, config,
        model=spec["model"](arch_name) if "model" in spec else None,
        data=spec["data"]() if "data" in spec else None,
        collator=spec["collator"]() if "collator" in spec else None,
        lookups=feature == "neftune",
        **spec.get("args", {}),
    )


@pytest.mark.parametrize("feature", list(FEATURES))
@pytest.mark.parametrize("arch_name", FEATURE_ARCHS)
def test_trainer_feature(arch_name, feature, tmp_path, zoo_tmp):
    arch = ARCHS[arch_name]
    spec = FEATURES[feature]
    method = spec["method"]
    base = baseline(arch_name, feature, zoo_tmp, lambda out: feature_run(arch_name, feature, out, None))
    run = feature_run(arch_name, feature, tmp_path, method_config(method))
    kw: dict = {}
    if feature == "grad_accum":
        assert len(run.mbs) == 2
        total = sum(int((t != IGNORE).sum()) for t in step_targets(arch, run))
        for mb in run.mbs:  # the Trainer normalizes over the whole step
            assert int(mb.kwargs["num_items_in_batch"]) == total
    if feature == "bf16":
        kw.update(rtol=1e-2, relative_norm=True)  # bf16 rounding gives ≈ 2.4e-3 here
    if feature == "label_smoothing":
        kw.update(smoothing=0.1)
    if feature == "peft_lora":
        kw.update(tied=False)  # modules_to_save trains a copy of the head, apart from the (frozen) embedding
    if feature == "flattening_simctg":
        (mb,) = run.mbs
        pos = mb.batch["position_ids"]
        assert mb.batch["input_ids"].shape[0] == 1 and int((pos == 0).sum()) == BATCH, "not one packed row of 4 examples"
        kw.update(segments=[zoo.packed_segments(pos)], alt_segments=True)
    if feature == "neftune":
        plain = baseline(arch_name, "plain", zoo_tmp, lambda out: train(arch, out))
        assert not torch.equal(run.mbs[0].x, plain.mbs[0].x), "NEFTune did not change the training forward"
        kw.update(forward=False)
        if arch.tied:  # the noisy forward: the tied lookup part from this run's own lookups
            check_neftune_tied(arch, run)
            check_logged(run)
            return
    if feature == "bf16":
        check_bf16_forward(run, base)
        kw.update(forward=False)
    check_method(arch, method, run, base, **kw)
    check_logged(run, *(("aniso/loss/simctg",) if method == "simctg" else ()))


def check_bf16_forward(run, base):
    """Under CPU autocast the plain head returns bf16 logits; AGG's returns the same GEMM in
    float32 (documented): equal to within one bf16 rounding."""
    x, z, bx, bz = run.mbs[0].x, run.mbs[0].z, base.mbs[0].x, base.mbs[0].z
    assert torch.equal(x, bx), f"bf16: the head's input differs from the run without the callback ({err(x, bx):.3e})"
    if fused(run):
        return
    scale = float(bz.float().abs().max())
    assert err(z.float(), bz.float()) <= 2**-7 * scale, f"bf16: head output differs by {err(z.float(), bz.float()):.3e}"


def check_neftune_tied(arch, run):
    ref = output_side(arch, run, "agg")
    check_reference_matches_trainer(arch, run, ref, what=f"{arch.name}/neftune")
    lookups = [slot for mb in run.mbs for slot in mb.lookups]
    assert lookups and all(g is not None for _, g in lookups), "input-embedding lookups were not captured"
    lookup = zoo.lookup_grad(lookups, VOCAB, run.w_before.shape[1])
    plain = output_side(arch, run)
    assert_distinct(ref["dW"], plain["dW"], 1e-4 * float(ref["dW"].abs().max()), "neftune: AGG gating")
    assert_close(run.grads["weight"], lookup + ref["dW"], f"{arch.name}/neftune/agg: head weight gradient",
                 alternatives={"without gating": lambda: lookup + plain["dW"]})


@pytest.mark.parametrize("arch_name", FEATURE_ARCHS)
def test_peft_frozen_head_is_refused(arch_name, tmp_path):
    """LoRA without modules_to_save freezes the head: AGG (a head-gradient method) must be refused
    at Trainer(...) with a pointer to modules_to_save."""
    model = lora_model(arch_name, modules_to_save=None)
    with pytest.raises(SetupError, match="modules_to_save"):
        Trainer(
            model=model, args=TrainingArguments(output_dir=str(tmp_path), **QUIET), train_dataset=zoo.CausalData(),
            callbacks=[AnisoCallback(method_config("agg"))],
        )


@pytest.mark.parametrize("arch_name", FEATURE_ARCHS)
def test_resume_equals_uninterrupted_run(arch_name, tmp_path):
    arch = ARCHS[arch_name]
    cfg = method_config("agg")
    args = dict(max_steps=2, save_strategy="steps", save_steps=1, lr_scheduler_type="constant", learning_rate=5e-2)
    straight = train(arch, tmp_path / "a", cfg, record=False, **args)  # writes checkpoint-1 on the way
    ckpt = tmp_path / "a" / "checkpoint-1"
    assert ckpt.is_dir()
    resumed = train(arch, tmp_path / "b", cfg, record=False, resume=str(ckpt), **args)
    for (name, p), (_, q) in zip(straight.model.named_parameters(), resumed.model.named_parameters()):
        assert torch.equal(p, q), f"{name}: the resumed run differs from the uninterrupted one ({err(p, q):.3e})"
    a, b = straight.callback.session.plugins.state_dict(), resumed.callback.session.plugins.state_dict()
    assert a.keys() == b.keys()
    for ns in a:
        for k in a[ns]:
            assert torch.equal(a[ns][k], b[ns][k]), (ns, k)
    check_logged(resumed)
    # the comparison is sensitive: resuming without the AGG counter gives other parameters
    bare = tmp_path / "bare-checkpoint-1"
    shutil.copytree(ckpt, bare)
    for f in os.listdir(bare):
        if f.startswith("aniso_state"):
            os.remove(bare / f)
    fresh = train(arch, tmp_path / "c", cfg, record=False, resume=str(bare), **args)
    assert any(not torch.equal(p, q) for p, q in zip(straight.model.parameters(), fresh.model.parameters())), \
        "resuming without the counter gives the same parameters: the resume comparison would not see a lost counter"


# --- Seq2SeqTrainer evaluation ----------------------------------------------------------------
@pytest.mark.parametrize("generate", [False, True], ids=["teacher_forced", "predict_with_generate"])
def test_seq2seq_trainer_eval_metrics(generate, tmp_path):
    """Seq2SeqTrainer evaluation of Bart (final_logits_bias zero, so head output = logits):
    eval/ppl and eval/uniq come from the teacher-forced logits of the labels, also when
    predict_with_generate makes the Trainer call generate() (more head calls) first."""
    arch = ARCHS["bart"]
    model = arch.build()
    with torch.no_grad():
        model.final_logits_bias.zero_()
    eval_data = zoo.Seq2SeqData(n=BATCH, seed=7)
    cfg = AnisoConfig(metrics=("eval",), load_entry_points=False)
    args = Seq2SeqTrainingArguments(
        output_dir=str(tmp_path), predict_with_generate=generate, generation_max_length=zoo.TGT_LENGTH + 1,
        generation_num_beams=1, per_device_eval_batch_size=BATCH, **QUIET,
    )
    seen = []

    def compute_metrics(prediction):  # without compute_metrics the Trainer evaluates the loss only, never generating
        seen.append(prediction.predictions)
        return {"rows": float(len(prediction.predictions))}

    trainer = Seq2SeqTrainer(model=model, args=args, train_dataset=arch.data(), eval_dataset=eval_data,
                             callbacks=[AnisoCallback(cfg)], compute_metrics=compute_metrics)
    trainer.train()
    metrics = trainer.evaluate()
    (predictions,) = seen
    if generate:  # generated token ids, not the logits: generate() really ran (its head calls come first)
        assert predictions.ndim == 2 and predictions.dtype.kind == "i", predictions.shape
    else:  # (logits, encoder states)
        assert (predictions[0] if isinstance(predictions, tuple) else predictions).shape[-1] == VOCAB
    batch = default_data_collator([eval_data[i] for i in range(len(eval_data))])
    model.eval()
    with torch.no_grad():
        logits = model(**batch).logits.double()
    y = batch["labels"]
    keep = y != IGNORE
    nll = torch.logsumexp(logits[keep], -1) - logits[keep].gather(1, y[keep][:, None]).squeeze(1)
    ppl = float(torch.exp(nll.mean()))
    uniq = len(set(logits[keep].argmax(-1).tolist()))
    assert metrics["eval_aniso/eval/ppl"] == pytest.approx(ppl, rel=1e-5)
    assert metrics["eval_aniso/eval/uniq"] == uniq
    assert metrics["eval_loss"] == pytest.approx(float(nll.mean()), rel=1e-5)  # the reference is the Trainer's loss


# --- evaluation metrics of models with a post-head transform -------------------------------------
@pytest.mark.parametrize("arch_name", ["gpt2", "gemma2_softcap", "bart", "marian"])
def test_eval_metrics_are_those_of_the_models_logits(arch_name, tmp_path):
    """eval/ppl = exp(mean NLL) and eval/uniq (distinct argmax) of the model's predictive
    distribution, i.e. of its logits after the post-head transform (Gemma2's soft-cap, Bart /
    Marian's final_logits_bias); gpt2 (no transform) is the control. The Trainer's eval_loss is
    the same mean NLL (one evaluation batch)."""
    arch = ARCHS[arch_name]
    eval_data = arch.data(n=BATCH, seed=7)
    run = train(arch, tmp_path, AnisoConfig(metrics=("eval",), load_entry_points=False), record=False,
                per_device_eval_batch_size=BATCH)
    run.trainer.eval_dataset = eval_data
    metrics = run.trainer.evaluate()
    batch = default_data_collator([eval_data[i] for i in range(len(eval_data))])
    model = run.model.eval()
    seen = {}
    hook = zoo.head_of(model).register_forward_hook(lambda m, a, out: seen.setdefault("z", out.detach()))
    with torch.no_grad():
        logits = model(**batch).logits.double()
    hook.remove()
    y = zoo.targets_for(arch.kind, batch["labels"])
    keep = y != IGNORE

    def ppl_uniq(z):
        z = z.double()[keep]
        nll = torch.logsumexp(z, -1) - z.gather(1, y[keep][:, None]).squeeze(1)
        return float(torch.exp(nll.mean())), len(set(z.argmax(-1).tolist())), float(nll.mean())

    ppl, uniq, mean_nll = ppl_uniq(logits)
    raw_ppl, raw_uniq, _ = ppl_uniq(seen["z"])
    assert metrics["eval_loss"] == pytest.approx(mean_nll, rel=1e-5)  # the reference is the Trainer's own loss
    got = metrics["eval_aniso/eval/ppl"]
    assert got == pytest.approx(ppl, rel=1e-5), (
        f"eval/ppl = {got:.6g}, the model's perplexity exp(eval_loss) = {ppl:.6g}; "
        f"the perplexity of the raw head output (before the model's post-head transform) = {raw_ppl:.6g}")
    assert metrics["eval_aniso/eval/uniq"] == uniq, (
        f"eval/uniq = {metrics['eval_aniso/eval/uniq']}, of the model's logits {uniq}, of the raw head output {raw_uniq}")
