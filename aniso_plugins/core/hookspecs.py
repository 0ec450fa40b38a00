"""Hook specifications: the contract between the core, the plugins and the trainer adapters.

An adapter (HF Trainer, Lightning, torchtitan) drives these events through its
`aniso_plugins.TrainingSession`, which calls them through `AnisoPlugins`; plugins implement any
subset with ``@hookimpl``. Built-in methods and metrics are plugins
registered through the same hooks as third-party ones (`aniso_make_plugins`).

Every hook is called on **every rank**, in the same order, so plugins may rely on
`aniso_plugins.numerics.reduce.reduce_stats` being called collectively by the core. Plugins never run
collectives of their own inside a hook unless the spec says the hook is collective.

Order of events (docs/design.md walks through each adapter)::

    aniso_make_plugins -> aniso_supplies_loss (capability)
    -> aniso_refuse_layout -> aniso_setup -> aniso_reads_training_logits, aniso_head_computes_loss (capabilities)
    -> aniso_begin_training [-> aniso_load_state_dict]
    per optimizer step with A micro-batches:
        [aniso_step_targets(every micro-batch's targets)]
        aniso_targets(m=0) forward [aniso_activation_loss_terms] backward ...
        aniso_targets(m=A-1) forward [aniso_activation_loss_terms] [aniso_loss_terms] backward
        (gradient clipping, optimizer step) aniso_step_end
        at measurement steps: aniso_metric_stats(round 0, 1, ...) -> aniso_metrics -> aniso_log
    after the last step: aniso_end_training
    evaluation: aniso_eval_batch per batch, then aniso_metric_stats / aniso_metrics / aniso_log (kind "eval")
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    import torch

    from aniso_plugins.core.config import AnisoConfig
    from aniso_plugins.core.layout import ParallelLayout
    from aniso_plugins.core.model import ModelHandle
    from aniso_plugins.core.steps import RunInfo, StepInfo
    from aniso_plugins.numerics.reduce import Stat

PROJECT = "aniso_plugins"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def aniso_make_plugins(config: AnisoConfig) -> list[object] | None:
    """Return plugin objects to register for `config` (possibly none).

    Called once per rank when `AnisoPlugins` is built, on every module registered through
    the ``aniso_plugins`` entry-point group and on the built-in `aniso_plugins.core.builtins`. Each returned
    object is registered and receives the other hooks. Read only the fields you own; raise
    `aniso_plugins.ConfigError` for a value you cannot honour."""


@hookspec
def aniso_head_computes_loss(owns_loss: bool, why_not: str) -> bool | None:
    """Whether this plugin makes the LM head return a training micro-batch's loss itself (its
    summed token cross-entropy divided by ``step.loss_normalizer``, or the sum when that is None)
    instead of logits, as the fused loss does. Asked once, right after set-up; `owns_loss` says
    whether the adapter can take the loss from the head and reproduce the model's own loss
    exactly, and `why_not`, when it cannot, why (for the message). Return True only then; raise
    `aniso_plugins.ConfigError` for a configuration that needs it from an adapter that cannot.
    A plugin answering True prepares the head here (set-up is transactional around it)."""


@hookspec
def aniso_reads_training_logits() -> str | None:
    """If this plugin reads the LM head's logits (or their gradient) in training micro-batches,
    a phrase saying so ("the gradient-bottleneck probe reads the logits' gradient"): the head
    then returns logits, not the fused loss."""


@hookspec
def aniso_supplies_loss() -> bool | None:
    """Whether a training batch without labels can train on this plugin's loss terms alone (as
    unsupervised SimCSE does): the adapter then backpropagates the session's
    ``supplied_loss()`` instead of the model's loss."""


@hookspec
def aniso_refuse_layout(layout: ParallelLayout) -> str | None:
    """If this plugin cannot serve the run's parallel layout (`aniso_plugins.ParallelLayout`: its
    meshes, pipeline stages, fixed parameters, a bypassed head), why and the way out, in one
    phrase ("metrics ['hidden'] under pipeline parallelism (4 stages): ...; measure them in a run
    without pipeline parallelism"); None if it can. Asked once per rank before `aniso_setup`:
    the session raises `aniso_plugins.SetupError` with every refusal before anything changes, so
    adapters never check method or metric names themselves."""


@hookspec
def aniso_setup(model: ModelHandle, config: AnisoConfig) -> None:
    """Set up on the model, once per rank, before the optimizer exists and before the trainer
    wraps the model (DDP / FSDP2): head surgery (untie, low-rank, gated forward), forward or
    backward hooks for probes. Head replacements run first (``tryfirst=True``), wrappers of the
    final head after them. Check here every configuration value that needs the model (ids
    against ``model.vocab_size``, ranks against ``model.hidden_size``), so a bad one fails
    before the first step. Raise `aniso_plugins.SetupError` for a model you cannot handle."""


@hookspec
def aniso_begin_training(run: RunInfo) -> None:
    """Training starts (or resumes): `run` says what the trainer knows (epoch length, resumed
    step, gradient accumulation). Build state whose size depends on it here (AGG builds its
    token counter, window ``config.window`` or ``run.epoch_steps``); raise
    `aniso_plugins.ConfigError` if the run lacks something you need.

    Called on every rank after `aniso_setup` and before the first `aniso_targets`, again if
    the trainer trains again. State from a checkpoint is restored after it
    (`aniso_load_state_dict`), so it may replace what this hook built."""


@hookspec
def aniso_step_targets(targets: Sequence[torch.Tensor], step: StepInfo) -> None:
    """See the targets of every **training** micro-batch of optimizer step `step.step` at once,
    before the first one's forward: this rank's micro-batches of the step, in order, each
    aligned as in `aniso_targets` (``step.micro_batch`` is 0; ``step.accumulation_steps`` is
    how many there are, the layout's pipeline micro-batches included).

    For a plugin whose method reads "the batch" of an optimizer step (AGG's token counter): it
    sees the whole step here, so its update does not depend on how the trainer splits the step
    into micro-batches (gradient accumulation) or ranks (summed over ``step.batch_group``).
    Implementing it makes adapters announce each step (`TrainingSession.wants_step_targets`);
    a step of one micro-batch may come without it (the plugin then reads that micro-batch's
    `aniso_targets`). Collective-safe, as `aniso_targets`."""


@hookspec
def aniso_targets(targets: torch.Tensor, step: StepInfo) -> None:
    """See the targets of one **training** micro-batch before its forward and backward.

    `targets` holds the next-token ids aligned with the LM head's output positions (the causal
    shift already done, shape ``(..., T)``), ``config.ignore_index`` where no loss is taken.
    Called once per micro-batch, `step.micro_batch` counting from 0 within the optimizer step.
    Never called for validation or evaluation batches. Collective-safe: every rank calls it for
    every micro-batch in the same order, so a plugin may all_reduce here (AGG sums its
    micro-batch token counts so that every rank computes identical gates)."""


@hookspec
def aniso_loss_terms(step: StepInfo) -> dict[str, torch.Tensor] | None:
    """Return extra loss terms, name -> differentiable scalar, for this optimizer step.

    Called on one micro-batch per optimizer step (the last, ``step.last_micro_batch``), inside
    that micro-batch's forward, unless ``config.reg_every_microbatch`` (then on every
    micro-batch, and a term must carry its own 1 / ``step.accumulation_steps``). The core sums
    all terms; the adapter makes the gradient of the sum reach the parameters exactly once per
    optimizer step, before gradient clipping, with the same value on every rank (each term
    must therefore be the global value, identical across ranks). Values are logged as
    ``aniso/loss/<name>``."""


@hookspec
def aniso_activation_loss_terms(
    hidden: torch.Tensor, targets: torch.Tensor, step: StepInfo
) -> dict[str, torch.Tensor] | None:
    """Return loss terms that depend on this training micro-batch's activations, name ->
    differentiable scalar (SimCTG, uniformity of hidden states, SimCSE).

    `hidden` is the LM head's input for the micro-batch, ``(..., T, d)``, in the autograd graph
    (a term's gradient flows back through the model; the head's own gradient path is not
    touched, so probes on the head see only the head's contribution); `targets` are the aligned
    targets ``(..., T)`` (``config.ignore_index`` at positions without a loss, padding included);
    ``step.input_ids`` / ``step.attention_mask`` carry the batch's inputs when the adapter has
    them. A plugin that reads other activations (a block's output, through its own forward hook
    registered in `aniso_setup`) may ignore `hidden` and return its term here: the call comes
    after the whole model but the head has run.

    Called on every training micro-batch (each has its own activations), on every rank, once,
    inside the forward: in the LM head's forward hook, or, where the adapter calls the head on
    chunks of the micro-batch (torchtitan), on the whole micro-batch before its loss.

    **Shares.** Each rank returns its share of the term: the parameters receive the gradient
    of the **sum of the shares over the ranks and the micro-batches** of the optimizer step,
    whatever the trainer's averaging (the core rescales). A term defined as a mean over the
    step's global batch therefore divides its local sum by the global count, which it can
    all-reduce in `aniso_targets` (collective-safe), and a term defined per micro-batch
    divides by ``step.accumulation_steps``. Return the same names on every rank (a zero share
    when a rank has nothing). The values logged as ``aniso/loss/<name>`` are the sums of the
    shares over ranks and micro-batches of the measured step."""


@hookspec
def aniso_step_end(step: StepInfo) -> None:
    """The optimizer step `step.step` has been applied (weights updated, gradients about to be
    zeroed). Advance counters and schedules here. Collective-safe: every rank calls it once
    per optimizer step in the same order (a plugin may all_reduce its step's local counts)."""


@hookspec
def aniso_metric_stats(
    step: StepInfo, kind: str, round_index: int, reduced: Mapping[str, torch.Tensor]
) -> dict[str, Stat] | None:
    """Return the reducible statistics of measurement round `round_index`, name -> `Stat`
    (value and reduce op).

    `kind` is "train" (at measurement steps) or "eval" (after an evaluation loop). A
    measurement runs in rounds 0, 1, 2, ...: after each round the core reduces everything
    returned in one flat collective per (dtype, op) and adds it to `reduced` (all rounds so
    far), so a metric needing a second pass (eigenvectors of a reduced Gram matrix, then a
    distributed log-sum-exp) returns its first pass at round 0 and its second pass, computed
    from ``reduced``, at round 1. Return None for a round you have nothing for; the
    measurement ends after the first round where no plugin returns anything. Names must be
    unique across plugins (prefix them with your plugin's name) and identical on every rank."""


@hookspec
def aniso_metrics(step: StepInfo, kind: str, reduced: Mapping[str, torch.Tensor]) -> dict[str, float] | None:
    """Finish metrics from the reduced statistics, name -> Python float, on every rank.

    Names are relative (``"geometry/mean_cosine"``); the core prefixes ``aniso/`` (and the
    adapter its own ``eval`` prefix for `kind` "eval"). Every rank computes identical values."""


@hookspec
def aniso_eval_batch(logits: torch.Tensor, targets: torch.Tensor) -> None:
    """See one evaluation batch: logits ``(..., T, V)`` (local vocabulary, full rows) and the
    aligned targets ``(..., T)``. Accumulate local statistics for `aniso_metric_stats` with
    ``kind == "eval"``; reset them when that measurement has been finished."""


@hookspec
def aniso_log(metrics: Mapping[str, float], step: int, kind: str) -> None:
    """Observe finished metrics (already prefixed), e.g. to send them to an extra sink. The
    adapter has already put them into the trainer's own logger. Called on every rank."""


@hookspec
def aniso_summary_metrics() -> dict[str, str] | None:
    """The few of your metrics that say at a glance whether the method or metric works, as
    short label -> metric name (relative, as `aniso_metrics` returns it), e.g.
    ``{"I(W)": "geometry/head/isotropy"}``: the adapters show them in one line per logging step
    (the HF Trainer's printed log, Lightning's progress bar), while the trainer's loggers get
    every metric."""


@hookspec
def aniso_end_training(output_dir: str, main_process: bool) -> None:
    """Training has ended (the trainer's own end of training; an interrupted run never gets
    here). `output_dir`: the trainer's output folder (HF ``args.output_dir``, Lightning
    ``default_root_dir``); `main_process`: whether this is the process that writes files.
    Called on every rank; a monitoring plugin catches its own failures."""


@hookspec
def aniso_state_dict() -> dict[str, dict[str, torch.Tensor]] | None:
    """Return state to checkpoint as ``{namespace: {key: tensor}}`` (namespace: your plugin's
    name). Must be identical on every rank (reduce first); rank 0 writes it."""


@hookspec
def aniso_load_state_dict(state: Mapping[str, Mapping[str, torch.Tensor]]) -> None:
    """Restore from what `aniso_state_dict` returned; take your namespace, ignore the others.
    Called on every rank before the first training step of a resumed run."""
