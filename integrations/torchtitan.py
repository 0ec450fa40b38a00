"""torchtitan 0.3.0 adapter: the ``--aniso.*`` flags, the chunked loss, metrics and DCP state.

Two ways to turn aniso_plugins on (docs/design.md, "torchtitan"):

1. Recipes (flags)::

       torchrun --nproc_per_node 8 -m torchtitan.train \\
           --module aniso_plugins.integrations.torchtitan --config llama3_debugmodel_aniso \\
           --aniso.method agg --aniso.alpha 0.03 --aniso.window 1000

   `AnisoTrainer.Config` adds the ``aniso`` section (every `aniso_plugins.AnisoConfig` field is
   a flag; invalid values raise `aniso_plugins.ConfigError` naming the field). Recipes:
   `llama3_debugmodel_aniso`, `llama3_1b_aniso`, `llama3_3b_aniso`; `aniso_trainer_config`
   turns any ``Trainer.Config`` recipe of your own into one.

2. Overrides on a stock recipe (``--module llama3 --config llama3_8b``)::

       --training.disable_cuda_graphs --override.imports aniso_plugins.integrations.torchtitan.aniso_metrics,\\
       aniso_plugins.integrations.torchtitan.aniso_checkpoint \\
       'aniso_plugins.integrations.torchtitan.aniso_loss={"method": "agg", "window": 1000}'

   `aniso_loss` carries the configuration (the `AnisoConfig` fields as JSON), `aniso_metrics`
   logs the metrics, `aniso_checkpoint` connects the run to the trainer and checkpoints the
   plugin state (required: without it the loss raises at the first step). The LM head stays
   torchtitan's own module: AGG installs its gated forward on it in place
   (`aniso_plugins.TrainingHead`), as in every adapter.

What runs where (torchtitan calls the loss once per micro-batch; its `ChunkedLossWrapper` calls
the LM head once per sequence chunk):

- `AnisoChunkedLoss` (a `ChunkedLossWrapper`; the micro-batch is announced before the model's
  forward from torchtitan's ``forward_backward_step``, or by the loss itself per pipeline
  micro-batch): per training micro-batch it hands the labels
  (aligned with the head's outputs already: torchtitan's datasets shift them), the number of
  head calls (``num_chunks``), torchtitan's ``global_valid_tokens`` and, with document
  masking, the documents of each packed row (from the ``positions`` that restart per
  document) to `aniso_plugins.TrainingSession.begin_micro_batch`; the plugins do the rest (AGG counts the
  targets, summed over the data-parallel ranks, and arms the head). When the session says the
  head computes the loss (``fused_loss``: by default with ``method="agg"`` and torchtitan's
  cross-entropy) it calls the head once on the micro-batch's hidden states and returns what the
  head returns: the fused chunked (AGG) cross-entropy normalized by ``global_valid_tokens``,
  never the full logits. Otherwise it is torchtitan's own chunked loss, whose head calls (gated
  by AGG with ``--aniso.fused-loss False``, one target chunk per call) are torchtitan's. Validation calls (no
  ``global_valid_tokens``) are torchtitan's loss inside ``session.evaluating(labels,
  num_chunks)``: no counting, no loss terms; with ``eval`` metrics each chunk's logits feed
  ``aniso_eval_batch``.
- Loss terms (CosReg, hinge, spectrum) are attached by the session in the head's forward, once
  per optimizer step. torchtitan SUMS gradients over data-parallel ranks, so every rank adds
  the (identical, global) term with weight 1/dp (``session.begin_training(loss_scale=1/dp)``).
  Activation-dependent terms (SimCTG, uniformity of hidden states) are attached to the
  micro-batch's whole hidden states before the chunked loss
  (`aniso_plugins.TrainingSession.attach_activation_terms`): each rank's share with weight 1.
- Where a plugin reads each optimizer step's whole batch (AGG's token counter), ``train_step`` is
  wrapped to announce all of the step's micro-batches before the first forward
  (`aniso_plugins.TrainingSession.begin_step`): AGG's update is then the same for any split of
  the step into accumulation steps, pipeline micro-batches and data-parallel ranks.
- After each optimizer step (an optimizer step post-hook) the session advances its counters
  and, at measurement steps, measures (collective, every rank); `AnisoMetricsProcessor` adds
  the ``aniso/...`` values to torchtitan's own log record (TensorBoard / W&B) at that step, and
  the evaluation metrics to the validation record (``validation_metrics/aniso/...``).
- The plugin state is a DCP ``Stateful`` at ``checkpointer.states["aniso"]`` (identical on every
  rank). A checkpoint written without it (stock torchtitan, or before aniso_plugins was
  enabled) resumes with ``--checkpoint.exclude_from_loading aniso`` (the counters start empty).

CUDA graphs: the session runs Python per micro-batch inside the loss (counter updates, gates,
loss terms), which a captured graph would freeze after the first step, so the recipes set
``training.disable_cuda_graphs=True`` and the adapter refuses to run with graphs on.

Parallel layouts (`aniso_plugins.integrations.torchtitan_layout.layout_of`; docs/trainers.md,
"Parallel layouts"): data parallel (``dp_replicate``, ``dp_shard``, both: HSDP), tensor parallel
(the head computes its loss on its vocabulary shard), pipeline parallel (every schedule: the
session lives on the stage that holds the LM head, whose ranks are its world) and expert
parallel; context parallelism raises `aniso_plugins.SetupError`. ``head`` must stay "keep"
(torchtitan builds the model from its config: untie with the model config's
``enable_weight_tying=False``).
"""

from __future__ import annotations

import dataclasses
import io
import logging
from dataclasses import dataclass, field
from typing import Annotated, Any

import torch
from torch import nn

from aniso_plugins import AnisoConfig, ConfigError, MicroBatchTargets, ModelHandle, ParallelLayout, SetupError, TrainingSession
from aniso_plugins import sequence_ids
from aniso_plugins.integrations.torchtitan_layout import layout_of

try:
    import tyro
    from torch.distributed.checkpoint.stateful import Stateful
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.loss import IGNORE_INDEX, ChunkedLossWrapper, CrossEntropyLoss
    from torchtitan.components.metrics import MetricsProcessor
    from torchtitan.config.override import derive, override
    from torchtitan.models.common.linear import Linear
    from torchtitan.trainer import Trainer
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        'aniso_plugins.integrations.torchtitan needs torchtitan 0.3.0: pip install "aniso-plugins[torchtitan]"'
    ) from e

logger = logging.getLogger("aniso_plugins.torchtitan")

STATE_KEY = "aniso"
"""Key of the plugin state in ``checkpointer.states`` (and in DCP checkpoints)."""


def default_config(**fields: Any) -> AnisoConfig:
    """`AnisoConfig` with the defaults the features declare for torchtitan
    (`AnisoConfig.adapter_defaults`) and `fields`."""
    return AnisoConfig.from_dict({**AnisoConfig.adapter_defaults("torchtitan"), **fields})


# --- model -------------------------------------------------------------------------------------
class TitanModelHandle(ModelHandle):
    """`ModelHandle` for torchtitan decoders: ``lm_head``, ``tok_embeddings`` and the
    ``layers`` ModuleDict (in order). torchtitan's ``Module.parallelize`` sets the head's
    instance forward to its class forward between input and output redistributions, which
    change no value under data parallelism and under tensor parallelism with the spmd_types
    backend (input replicated to replicated, output vocabulary-sharded to vocabulary-sharded:
    loss parallel: the layout's ``vocab_mesh``, `layout_of`)."""

    framework_wraps_head_forward = True

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model, head="lm_head", input_embedding="tok_embeddings", blocks="layers")
        self._vocab_size = self.head().weight.shape[0]  # the DTensor's global rows (a shard inside the forward)

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def input_embedding(self) -> nn.Module | None:
        """The token embedding; None on a pipeline stage that does not hold it."""
        embedding = getattr(self.model, "tok_embeddings", None)
        return embedding if isinstance(embedding, nn.Module) else None

    def blocks(self) -> list[nn.Module]:
        layers = getattr(self.model, "layers", None)
        return list(layers.values()) if isinstance(layers, nn.ModuleDict) else list(layers or ())


# --- loss --------------------------------------------------------------------------------------
class AnisoChunkedLoss(ChunkedLossWrapper):
    """torchtitan's chunked loss with the session's per-micro-batch events (see the module
    docstring). For ``method != "agg"`` its value and gradients are `ChunkedLossWrapper`'s."""

    @dataclass(kw_only=True, slots=True)
    class Config(ChunkedLossWrapper.Config):
        aniso: Annotated[AnisoConfig | None, tyro.conf.Suppress] = None
        """The configuration on the override path (`aniso_loss` kwargs); `AnisoTrainer` uses
        its ``--aniso`` section instead."""

    def __init__(self, config: Config, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        self.aniso_config = config.aniso
        self.runtime: AnisoRuntime | None = None

    def __call__(
        self,
        pred: torch.Tensor,
        labels: torch.Tensor,
        global_valid_tokens: torch.Tensor | None = None,
        **loss_inputs: Any,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        runtime = self.runtime
        if global_valid_tokens is None or not (pred.requires_grad and torch.is_grad_enabled()):  # validation
            if runtime is None:
                return super().__call__(pred, labels, global_valid_tokens, **loss_inputs)
            with runtime.session.evaluating(labels, head_calls=self.num_chunks):
                return super().__call__(pred, labels, global_valid_tokens, **loss_inputs)
        if runtime is None:
            raise SetupError(
                "AnisoChunkedLoss is not connected to the trainer: use an AnisoTrainer recipe, or add "
                "aniso_plugins.integrations.torchtitan.aniso_checkpoint to --override.imports"
            )
        if runtime.inferring_pipeline_metadata():  # a real forward-backward whose gradients are dropped
            return (pred * 0.0).sum(), {}
        if not runtime.announced:  # pipeline parallel: the schedule calls the loss per pipeline micro-batch
            runtime.begin_micro_batch(labels, global_valid_tokens, positions=loss_inputs.get("positions"))
        runtime.announced = False
        pred = runtime.session.attach_activation_terms(pred)  # SimCTG & co. on the whole micro-batch
        if runtime.session.head_computes_loss:
            # a scalar of its own, not a view (attach_loss's): pipeline schedules detach_() the loss in place
            return self.lm_head(pred).clone(), {}
        return super().__call__(pred, labels, global_valid_tokens, **loss_inputs)


# --- metrics -----------------------------------------------------------------------------------
class AnisoMetricsProcessor(MetricsProcessor):
    """torchtitan's `MetricsProcessor` plus the aniso metrics, written by torchtitan's own
    loggers (TensorBoard / W&B) at the step they were measured at: training metrics
    (``aniso/...``, measured after the optimizer step) join that step's record in `log`, or are
    written on their own at steps torchtitan does not log (``--aniso.metrics_every``);
    evaluation metrics (``validation_metrics/aniso/...``, e.g. ``eval`` perplexity per
    frequency group) are measured over the validation batches and join `log_validation`."""

    @dataclass(kw_only=True, slots=True)
    class Config(MetricsProcessor.Config):
        pass

    def __init__(self, config: Config, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        self.aniso_pending: dict[str, float] = {}
        self.runtime: AnisoRuntime | None = None

    def add_aniso(self, metrics: dict[str, float], step: int) -> None:
        """Metrics measured at `step`: kept for `log` if torchtitan logs `step`, written now otherwise."""
        if self.should_log(step):
            self.aniso_pending.update(metrics)
        elif metrics:
            self.logger.log(dict(metrics), step)

    def log(
        self,
        step: int,
        global_avg_loss: float,
        global_max_loss: float,
        grad_norm: float,
        extra_metrics: dict[str, Any] | None = None,
    ) -> None:
        extra = {**(extra_metrics or {}), **self.aniso_pending}
        self.aniso_pending = {}
        super().log(step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=extra)

    def log_validation(self, loss: float, step: int, extra_metrics: dict[str, Any] | None = None) -> None:
        extra = dict(extra_metrics or {})
        if self.runtime is not None and self.runtime.session.wants_eval_batches:
            # collective: torchtitan validates on every rank
            self.runtime.session.measure_and_log(step, "eval", extra.update, prefix="validation_metrics/")
        super().log_validation(loss, step, extra_metrics=extra)


# --- checkpoint state --------------------------------------------------------------------------
class AnisoCheckpointState(Stateful):
    """The session's state as one DCP entry (``aniso.state``): the plugins' tensors are
    serialized to bytes because their shapes change during training (AGG's sparse window),
    which DCP's in-place tensor loading cannot follow. Identical on every rank (counters are
    all-reduced), so DCP's de-duplication keeps a correct copy."""

    def __init__(self, session: TrainingSession) -> None:
        self.session = session

    def state_dict(self) -> dict[str, bytes]:
        buffer = io.BytesIO()
        torch.save(self.session.state_dict(), buffer)
        return {"state": buffer.getvalue()}

    def load_state_dict(self, state_dict: dict[str, bytes]) -> None:
        where = f"the DCP checkpoint entry {STATE_KEY!r}"
        with self.session.reading_state(where):
            self.session.load_state_dict(torch.load(io.BytesIO(state_dict["state"]), weights_only=True), where=where)


class AnisoCheckpointManager(CheckpointManager):
    """torchtitan's DCP `CheckpointManager` that, on the override path, connects aniso_plugins
    to the trainer being built (it is the last component built before training) and registers
    the plugin state. Under `AnisoTrainer` it is a plain `CheckpointManager`."""

    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):
        pass

    def __init__(self, config: Config, *, states: dict[str, Any], **kwargs: Any) -> None:
        super().__init__(config, states=states, **kwargs)
        trainer = states.get("train_state")
        if not isinstance(trainer, Trainer):
            raise SetupError("AnisoCheckpointManager: the trainer is not among the checkpoint states ('train_state')")
        if isinstance(trainer, AnisoTrainer):
            return  # AnisoTrainer connects itself after construction
        loss = getattr(trainer, "loss_fn", None)
        config_ = loss.aniso_config if isinstance(loss, AnisoChunkedLoss) else None
        AnisoRuntime.connect(trainer, config_ or default_config(), self)


# --- the connection between one trainer and one session ----------------------------------------
def _head_part(trainer: Trainer) -> nn.Module | None:
    """The model part of this rank that holds the LM head (the last one of the last pipeline
    stage; the whole model without pipeline parallelism), or None."""
    return next((part for part in reversed(trainer.model_parts) if getattr(part, "lm_head", None) is not None), None)


def _check_setup(trainer: Trainer, config: AnisoConfig) -> AnisoChunkedLoss:
    """Refuse what the adapter cannot run (each error names the fix); returns the trainer's loss."""
    loss = getattr(trainer, "loss_fn", None)
    if not isinstance(loss, AnisoChunkedLoss):
        raise SetupError(
            f"aniso_plugins needs the loss AnisoChunkedLoss (torchtitan's ChunkedLossWrapper with aniso "
            f"events), got {type(loss).__name__}: use aniso_trainer_config / the aniso_loss override "
            "on a recipe whose loss is ChunkedLossWrapper"
        )
    if loss.runtime is not None:
        raise SetupError("this AnisoChunkedLoss is already connected to a trainer")
    if not trainer.config.training.disable_cuda_graphs:
        raise SetupError(
            "training.disable_cuda_graphs=False: aniso_plugins runs Python in the loss on every micro-batch "
            "(token counters, AGG gates, loss terms), which a captured CUDA graph would freeze; "
            "pass --training.disable_cuda_graphs"
        )
    if config.ignore_index != IGNORE_INDEX:
        raise ConfigError(f"ignore_index={config.ignore_index!r}: torchtitan's labels use {IGNORE_INDEX}")
    return loss


class AnisoRuntime:
    """One `TrainingSession` connected to one built torchtitan ``Trainer``.

    trainer: the trainer (its loss must be `AnisoChunkedLoss`); config: the run's
    `AnisoConfig`; checkpointer: the trainer's checkpoint manager (passed because on the
    override path the trainer does not hold it yet).

    Effects: the session is set up on the model (after FSDP2), the loss gets ``runtime``, an
    optimizer step post-hook ends steps and measures, and, with checkpointing enabled,
    ``checkpointer.states["aniso"]`` holds `AnisoCheckpointState`.
    """

    @classmethod
    def connect(cls, trainer: Trainer, config: AnisoConfig, checkpointer) -> AnisoRuntime | None:
        """The runtime of this rank, or None on a pipeline stage without the LM head (there is
        nothing to count, gate or measure there; the stage's ranks run stock torchtitan).
        Collective: every rank calls it (the pipeline stages' groups are created here)."""
        layout = layout_of(trainer)
        TrainingSession(config).check_layout(layout)  # every stage refuses alike, those without the head too
        if _head_part(trainer) is None:
            logger.info("aniso_plugins: this pipeline stage holds no LM head; nothing runs on it")
            return None
        return cls(trainer, config, checkpointer, layout)

    def __init__(self, trainer: Trainer, config: AnisoConfig, checkpointer, layout: ParallelLayout | None = None) -> None:
        loss = _check_setup(trainer, config)
        layout = layout if layout is not None else layout_of(trainer)
        model = _head_part(trainer)
        if model is None:
            raise SetupError("aniso_plugins: no model part of this rank holds the LM head (use AnisoRuntime.connect)")
        session = TrainingSession(config)
        self.trainer = trainer
        self.session = session
        # the loss can come from the head only where it is the plain cross-entropy the head computes
        plain = type(loss.loss_fn) is CrossEntropyLoss
        why_not = "" if plain else f"the inner loss is {type(loss.loss_fn).__name__}, not torchtitan's cross-entropy"
        session.setup(TitanModelHandle(model), layout, owns_loss=plain, why_not=why_not)
        try:
            session.begin_training(start_step=trainer.step, accumulation_steps=trainer.gradient_accumulation_steps,
                                   optimizers=tuple(getattr(trainer.optimizers, "optimizers", ())))
        except BaseException:
            session.detach()  # a run that cannot begin leaves the model as it was
            raise
        self.metrics = trainer.metrics_processor
        if isinstance(self.metrics, AnisoMetricsProcessor):
            self.metrics.runtime = self
        elif config.metrics:
            logger.warning(
                "aniso metrics %s are measured but torchtitan's %s does not log them: use an aniso recipe or add "
                "aniso_plugins.integrations.torchtitan.aniso_metrics to --override.imports",
                config.metrics,
                type(self.metrics).__name__,
            )
        trainer.optimizers.register_step_post_hook(self._after_optimizer_step)
        self.announced = False
        self._announce_before_the_forward(trainer)
        if session.wants_step_targets:
            self._announce_each_step(trainer, layout.pipeline_micro_batches)
        if checkpointer.enable:
            checkpointer.states[STATE_KEY] = AnisoCheckpointState(self.session)
        loss.runtime = self

    def inferring_pipeline_metadata(self) -> bool:
        """Whether torch's pipeline schedule is inferring its stages' backward metadata: before
        its first backward (and after a switch from evaluation) it runs the loss on the first
        micro-batch once more and throws the gradients away. That call must not count or gate
        anything, nor call the head; any loss of the output's shape serves it."""
        schedule = getattr(self.trainer, "pp_schedule", None)
        if schedule is None:
            return False
        for flag in ("_stages_backward_initialized", "_stage_backward_initialized"):  # multi-stage, single-stage
            if hasattr(schedule, flag):
                return not getattr(schedule, flag)
        return False

    def _announce_before_the_forward(self, trainer: Trainer) -> None:
        """Announce each micro-batch before the model's forward (so that metrics of the blocks'
        outputs see a measured micro-batch), from torchtitan's ``forward_backward_step``, wrapped
        on the trainer instance; the loss then finds it announced. Not under pipeline
        parallelism, where the loss announces each pipeline micro-batch itself."""
        original = trainer.forward_backward_step

        def forward_backward_step(*, input_dict, labels, global_valid_tokens, **kwargs):
            if isinstance(labels, torch.Tensor) and isinstance(input_dict, dict):
                self.begin_micro_batch(labels, global_valid_tokens, positions=input_dict.get("positions"))
                self.announced = True
            return original(input_dict=input_dict, labels=labels, global_valid_tokens=global_valid_tokens, **kwargs)

        trainer.forward_backward_step = forward_backward_step

    def _announce_each_step(self, trainer: Trainer, pipeline_micro_batches: int) -> None:
        """Where a plugin reads each optimizer step's whole batch (AGG), announce the step's
        micro-batches before its first forward: torchtitan's ``train_step`` reads all of them
        (gradient accumulation × pipeline micro-batches) from its data iterator before any
        forward; the wrapper, on the trainer instance, reads them the same way, announces their
        labels and hands ``train_step`` the same batches. Data running out mid-step raises
        torchtitan's own ``DataloaderExhaustedError`` here, as in ``train_step``."""
        original, count = trainer.train_step, trainer.gradient_accumulation_steps * pipeline_micro_batches

        def train_step(data_iterator):
            batches = [next(data_iterator) for _ in range(count)]
            self.session.begin_step([labels for _, labels in batches], step=self.trainer.step)
            return original(iter(batches))

        trainer.train_step = train_step

    def begin_micro_batch(
        self,
        labels: torch.Tensor,
        loss_normalizer: torch.Tensor,
        positions: torch.Tensor | None = None,
    ) -> None:
        """Announce a training micro-batch of the current step: torchtitan's `labels` are aligned
        with the head's outputs already (its datasets shift them); `positions`, with document
        masking, restart at each document of a packed row (`aniso_plugins.sequence_ids`). The
        chunked loss calls the head once per sequence chunk."""
        step, head_calls = self.trainer.step, self.trainer.loss_fn.num_chunks
        self.session.begin_micro_batch(
            MicroBatchTargets(labels, sequence_ids=sequence_ids(labels.shape, position_ids=positions)),
            step=step,
            accumulation_steps=self.trainer.gradient_accumulation_steps,
            measure=self.session.measures_at(step, self.metrics.should_log(step)),
            head_calls=head_calls,
            loss_normalizer=loss_normalizer,
        )

    def _after_optimizer_step(self, optimizer, args, kwargs) -> None:
        step = self.trainer.step
        self.session.end_step(step)
        if self.session.measures_at(step, self.metrics.should_log(step)):
            sink = (lambda m: self.metrics.add_aniso(m, step)) if isinstance(self.metrics, AnisoMetricsProcessor) else None
            self.session.measure_and_log(step, "train", sink)


# --- the trainer and the recipes ---------------------------------------------------------------
class AnisoTrainer(Trainer):
    """torchtitan's `Trainer` with an ``aniso`` configuration section (``--aniso.<field>``)."""

    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        aniso: AnisoConfig = field(default_factory=default_config)
        """aniso_plugins: methods and metrics (fields of aniso_plugins.AnisoConfig)."""

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self.aniso = AnisoRuntime.connect(self, config.aniso, self.checkpointer)


def aniso_trainer_config(base: Trainer.Config, aniso: AnisoConfig | None = None) -> AnisoTrainer.Config:
    """`base` (any llama-style ``Trainer.Config`` recipe with torchtitan's chunked loss) as an
    `AnisoTrainer.Config`: same fields, ``aniso`` section `aniso` (default: `default_config()`),
    loss `AnisoChunkedLoss`, metrics `AnisoMetricsProcessor`, CUDA graphs off. The model and
    its LM head are the recipe's. With ``--aniso.method none`` and no metrics the run equals
    `base`'s."""
    if not isinstance(base.loss, ChunkedLossWrapper.Config):
        raise SetupError(
            f"aniso_trainer_config: the recipe's loss is {type(base.loss).__name__}; aniso_plugins needs "
            "torchtitan's ChunkedLossWrapper (the default of the llama3 recipes)"
        )
    if base.model_spec is None or not isinstance(getattr(base.model_spec.model, "lm_head", None), Linear.Config):
        raise SetupError("aniso_trainer_config: the recipe's model has no Linear lm_head")
    values = {f.name: getattr(base, f.name) for f in dataclasses.fields(base) if f.init and f.name != "aniso"}
    config = AnisoTrainer.Config(**values, aniso=aniso if aniso is not None else default_config())
    config.loss = derive(config.loss, AnisoChunkedLoss.Config)
    config.metrics = derive(config.metrics, AnisoMetricsProcessor.Config)
    config.training.disable_cuda_graphs = True
    return config


def llama3_debugmodel_aniso() -> AnisoTrainer.Config:
    """torchtitan's ``llama3_debugmodel`` recipe (6 layers, d=256, V=2048, untied) with aniso_plugins."""
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    return aniso_trainer_config(llama3_debugmodel())


def _llama3_small(flavor: str, hf_assets_path: str) -> AnisoTrainer.Config:
    """torchtitan's ``llama3_8b`` training recipe with the model `flavor` (tied embeddings)."""
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.models.common.config_utils import decoder_vocab_size
    from torchtitan.models.llama3 import model_registry
    from torchtitan.models.llama3.config_registry import llama3_8b

    config = llama3_8b()
    config.model_spec = model_registry(flavor)
    config.loss.loss_fn = CrossEntropyLoss.Config(global_vocab_size=decoder_vocab_size(config.model_spec))
    config.hf_assets_path = hf_assets_path
    return aniso_trainer_config(config)


def llama3_1b_aniso() -> AnisoTrainer.Config:
    """Llama 3.2 1B (tied embeddings) on torchtitan's ``llama3_8b`` training settings."""
    return _llama3_small("1B", "./assets/hf/Llama-3.2-1B")


def llama3_3b_aniso() -> AnisoTrainer.Config:
    """Llama 3.2 3B (tied embeddings) on torchtitan's ``llama3_8b`` training settings."""
    return _llama3_small("3B", "./assets/hf/Llama-3.2-3B")


# --- overrides for stock recipes (--override.imports) ------------------------------------------
@override(
    target=ChunkedLossWrapper.Config,
    fqns=["loss"],
    description="aniso_plugins: chunked loss with the aniso events; kwargs are AnisoConfig fields",
)
def aniso_loss(cfg: ChunkedLossWrapper.Config, **aniso: Any) -> AnisoChunkedLoss.Config:
    """``loss``: `ChunkedLossWrapper` -> `AnisoChunkedLoss`; the JSON kwargs are `AnisoConfig`
    fields (``{"method": "agg", "window": 1000}``); unknown or invalid ones raise `ConfigError`."""
    return derive(cfg, AnisoChunkedLoss.Config, aniso=default_config(**aniso))


@override(
    target=MetricsProcessor.Config,
    fqns=["metrics"],
    exact=True,
    description="aniso_plugins: log the aniso/... metrics with torchtitan's",
)
def aniso_metrics(cfg: MetricsProcessor.Config) -> AnisoMetricsProcessor.Config:
    """``metrics``: `MetricsProcessor` -> `AnisoMetricsProcessor`."""
    return derive(cfg, AnisoMetricsProcessor.Config)


@override(
    target=CheckpointManager.Config,
    fqns=["checkpoint"],
    exact=True,
    description="aniso_plugins: connect the run and checkpoint the plugin state",
)
def aniso_checkpoint(cfg: CheckpointManager.Config) -> AnisoCheckpointManager.Config:
    """``checkpoint``: `CheckpointManager` -> `AnisoCheckpointManager` (required on the override path)."""
    return derive(cfg, AnisoCheckpointManager.Config)


__all__ = [
    "AnisoCheckpointManager",
    "AnisoCheckpointState",
    "AnisoChunkedLoss",
    "AnisoMetricsProcessor",
    "AnisoRuntime",
    "AnisoTrainer",
    "STATE_KEY",
    "TitanModelHandle",
    "aniso_checkpoint",
    "aniso_loss",
    "aniso_metrics",
    "aniso_trainer_config",
    "default_config",
    "llama3_1b_aniso",
    "llama3_3b_aniso",
    "llama3_debugmodel_aniso",
]
