"""The HF Trainer's parallel layout as the adapter reads it at ``Trainer(...)`` and at the start
of training: which engines it serves (DDP, accelerate's FSDP2 and FSDP1, DeepSpeed ZeRO-1/2/3,
each exact against one process: tests/test_hf_engines.py) and refuses, and how the Trainer and
its engine weigh the loss, which the loss terms must follow (docs/trainers.md, "Parallelism"), and
whether the fused loss reproduces the model's own (a soft-cap or scale of its logits included)."""

from __future__ import annotations

from aniso_plugins import DeepSpeedLossScale, GradScaler, LogitTransform, OutputEmbeddingsHandle, ParallelLayout, SetupError
from aniso_plugins.models.causal_loss import fused_loss_transform, loss_divides_by_item_count
from aniso_plugins.models.handle import peft_base_model
import aniso_plugins.integrations.hf.liger as liger
import aniso_plugins.integrations.hf.trl as trl

from transformers import Trainer


def loss_scaler(trainer: Trainer) -> GradScaler | None:
    """What the backward multiplies the loss by: accelerate's fp16 AMP scaler, or under DeepSpeed
    (whose fp16 loss scale accelerate does not hold) the engine's own."""
    if trainer.is_deepspeed_enabled:
        return DeepSpeedLossScale(trainer.model_wrapped)
    return getattr(trainer.accelerator, "scaler", None)


def fused_loss_refusal(trainer: Trainer, handle: OutputEmbeddingsHandle, ignore_index: int) -> str | None:
    """Why the fused loss cannot reproduce the model's own loss (`fused_loss_transform`), or None;
    sets ``handle.logit_transform`` to the soft-cap or scale its forward applies to the head's
    output. A transformed head is fused only where no engine hooks the head's output (FSDP and
    DeepSpeed pass it through functions of their own, which the fused sum's pass-through of the
    model's transform does not survive): there it stays on the gated head."""
    why_not, transform = fused_loss_transform(handle.model, ignore_index)
    handle.logit_transform = None
    if why_not is not None or transform.identity:
        return why_not
    if trainer.is_fsdp_enabled or trainer.is_deepspeed_enabled:
        engine = "FSDP" if trainer.is_fsdp_enabled else "DeepSpeed"
        return (f"the model transforms its logits (scale {transform.scale}, soft-cap {transform.softcap}), which is "
                f"fused only without {engine}")
    handle.logit_transform = transform
    return None


def head_transform(handle: OutputEmbeddingsHandle) -> LogitTransform:
    """``handle.logit_transform`` as the loss functions check it (the identity where None)."""
    return handle.logit_transform or LogitTransform()


def model_loss_scale(trainer: Trainer, handle: OutputEmbeddingsHandle, supplies_loss: bool = False) -> float:
    """The factor by which ``Trainer.training_step`` weighs the model's loss beyond its token mean
    over the step: the loss terms are given the same factor, so that their share of the
    objective is the configured one. transformers takes a model whose forward accepts
    ``**kwargs`` to divide its loss by ``num_items_in_batch`` (the step's target count over all
    ranks), so it skips the division by the accumulation steps and multiplies by the number of
    processes (``average_tokens_across_devices``). A forward that computes its own micro-batch
    mean instead (``CrossEntropyLoss()`` in Marian, T5, Bart, ...) thus trains on
    accumulation steps × processes times the mean; 1 for a model that divides by
    ``num_items_in_batch`` (``self.loss_function``), a ``compute_loss_func``, a label smoother, a
    forward without ``**kwargs``, and where the plugins may supply a batch's loss themselves
    (`supplies_loss`, SimCSE: a batch without labels has no ``num_items_in_batch``, and the
    Trainer divides that loss by the accumulation steps as usual)."""
    if trainer.compute_loss_func is not None or trainer.label_smoother is not None or supplies_loss:
        return 1.0
    if not trainer.model_accepts_loss_kwargs or loss_divides_by_item_count(handle.model):
        return 1.0
    scaled = getattr(trainer, "loss_is_scaled_for_ga", None)  # transformers >= 5.11; before, as None: the rule above
    scale = float(trainer.args.gradient_accumulation_steps) if scaled in (None, True) else 1.0
    if trainer.args.average_tokens_across_devices:
        scale *= trainer.accelerator.num_processes
    return scale


def layout_of(trainer: Trainer) -> ParallelLayout:
    """The `ParallelLayout` of a Trainer the adapter serves (`refusal` raises `SetupError` for
    the others): its engines all average gradients over whole micro-batches (the defaults);
    what the Trainer has fixed already: an optimizer it was given (no parameter can be added),
    TRL's trainers whose loss bypasses the head, and the chunked losses the head answers (TRL's
    SFTTrainer's fused LM head, Liger-Kernel's fused linear cross-entropy)."""
    why = refusal(trainer)
    if why is not None:
        raise SetupError(why)
    tokens = trl.token_outputs(trainer)
    return ParallelLayout(
        parameters_fixed="the Trainer was given an optimizer already; let the Trainer create its optimizer"
        if trainer.optimizer is not None else None,
        head_bypassed=trl.head_bypassed(trainer),
        chunked_loss="TRL's fused LM head" if tokens is not None else liger.chunked_loss(trainer, trainer.model),
        token_outputs=tokens,
        optimizer_flat=optimizer_flat(trainer),
    )


def optimizer_flat(trainer: Trainer) -> str | None:
    """Why the Trainer's engine steps flat buffers, not the model's parameters (`ParallelLayout.optimizer_flat`)."""
    if trainer.is_deepspeed_enabled:
        return ("DeepSpeed's ZeRO optimizer steps fp32 master copies in flat partitions of the parameters, not the "
                "model's rows: train with DDP or FSDP2 (fsdp_config={'fsdp_version': 2})")
    plugin = trainer.accelerator.state.fsdp_plugin if trainer.is_fsdp_enabled else None
    if plugin is not None and int(getattr(plugin, "fsdp_version", 1) or 1) == 1:
        return ("FSDP1 flattens the parameters into buffers sharded by elements, not rows: use FSDP2 "
                "(fsdp_config={'fsdp_version': 2})")
    return None


def refusal(trainer: Trainer) -> str | None:
    """Why the Trainer's parallel layout cannot be served exactly, or None. Served (each tested
    against one process, docs/trainers.md): DDP, accelerate's FSDP2 and FSDP1 (``FULL_SHARD``,
    ``SHARD_GRAD_OP``, ``NO_SHARD``; ``use_orig_params`` either way) and DeepSpeed ZeRO-1/2/3
    (with or without CPU offload). Refused: the layouts that split a head's vocabulary or a
    sequence over ranks, and hybrid sharding, none of them run through the Trainer here."""
    config = getattr(trainer.args, "parallelism_config", None)
    sizes = {name: int(getattr(config, f"{name}_size", None) or 1) for name in ("tp", "cp", "sp", "dp_replicate")}
    model_tp = int(getattr(peft_base_model(trainer.model), "tp_size", None) or 1)
    if sizes["tp"] > 1 or model_tp > 1:
        return (
            f"tensor parallelism through the Trainer (tp_size={max(sizes['tp'], model_tp)}): each rank holds a vocabulary "
            "shard of the LM head and of its logits, which the HF adapter does not route; train without tensor "
            "parallelism (FSDP2 or ZeRO-3 shard the model exactly), or use torchtitan, whose vocabulary-parallel fused "
            "loss is exact"
        )
    if sizes["cp"] > 1 or sizes["sp"] > 1:
        which = "context" if sizes["cp"] > 1 else "sequence"
        return (
            f"{which} parallelism (parallelism_config {which[0]}p_size={max(sizes['cp'], sizes['sp'])}): each rank holds a "
            "slice of every sequence, so the targets a rank announces are not its head's positions; train without it"
        )
    plugin = trainer.accelerator.state.fsdp_plugin if trainer.is_fsdp_enabled else None
    strategy = str(getattr(plugin, "reshard_after_forward", ""))  # FSDP1: its ShardingStrategy; FSDP2: a bool
    if sizes["dp_replicate"] > 1 or "HYBRID" in strategy.upper():
        return (
            "hybrid sharding (HSDP: parallelism_config dp_replicate_size > 1, or FSDP1 HYBRID_SHARD) is not tested "
            "through the Trainer: use full sharding (fsdp='full_shard', FSDP2 or FSDP1) or DeepSpeed ZeRO-3, both "
            "exact, or torchtitan, whose HSDP is exact"
        )
    return None


__all__ = ["fused_loss_refusal", "head_transform", "layout_of", "loss_scaler", "model_loss_scale", "optimizer_flat", "refusal"]
