"""The report's text pass: the built-in metric plugins (``frequency``, ``eval``, ``hidden``,
``bottleneck``) driven through `AnisoPlugins` over a text as an adapter drives them over one
evaluation pass (docs/report.md, "With a text")."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from aniso_plugins.core.config import AnisoConfig
from aniso_plugins.core.model import ModelHandle
from aniso_plugins.core.plugins import AnisoPlugins
from aniso_plugins.core.steps import StepInfo
from aniso_plugins.core.targets import causal_targets
from aniso_plugins.metrics.frequency.groups import GROUPS, frequency_groups
from aniso_plugins.models.handle import OutputEmbeddingsHandle
from aniso_plugins.offline.errors import ReportError
from aniso_plugins.offline.sources import LoadedModel

TARGET_COUNTS = "target_counts"
"""The state namespace of the target counts (`TargetCountsPlugin`) that define the groups."""


def tokens(loaded: LoadedModel, text: str, max_tokens: int) -> torch.Tensor:
    """The first `max_tokens` token ids of `text` with the model's tokenizer (tokenized by
    paragraphs, so a huge text stops early); checked against the vocabulary."""
    tok = loaded.tokenizer
    if tok is None:
        where = "a safetensors file" if loaded.kind == "safetensors" else "a directory without tokenizer files"
        raise ReportError(f"--text-file needs a tokenizer, but {loaded.path} is {where}")
    if loaded.model is None:
        raise ReportError(f"--text-file needs a model, but {loaded.path} holds only tensors")
    ids: list[int] = []
    # tokenize in pieces (by paragraphs) so huge texts stop early at max_tokens
    for piece in re.split(r"(\n\s*\n)", text):
        if not piece:
            continue
        ids += tok(piece, add_special_tokens=False)["input_ids"]
        if len(ids) >= max_tokens:
            break
    ids = ids[:max_tokens]
    vocab = loaded.model.get_input_embeddings().weight.shape[0]
    if len(ids) < 2:
        raise ReportError(f"the text gives {len(ids)} token(s) with the tokenizer of {loaded.path}; need at least 2")
    t = torch.tensor(ids, dtype=torch.long)
    if int(t.max()) >= vocab:
        raise ReportError(f"the tokenizer of {loaded.path} gives id {int(t.max())} >= the model's vocabulary {vocab}")
    return t


def sequence_length(model: nn.Module, cap: int = 256) -> int:
    """Tokens per evaluation sequence: min(cap, the model's maximum positions)."""
    cfg = getattr(model, "config", None)
    limit = None
    for attr in ("n_positions", "max_position_embeddings", "n_ctx"):
        limit = limit or getattr(cfg, attr, None)
    return int(min(cap, limit or cap))


def text_blocks(ids: torch.Tensor, length: int) -> torch.Tensor:
    """Consecutive (B, length) blocks of `ids`; the remainder is dropped (one shorter block if
    the text is shorter than `length`)."""
    if len(ids) < length:
        return ids[None]
    return ids[: len(ids) // length * length].view(-1, length)


class _EncoderHandle(ModelHandle):
    """A `ModelHandle` for an encoder without an LM head: the input embedding plays the head
    (the frequency-group geometry reads its rows) and the blocks are found as in
    `OutputEmbeddingsHandle`."""

    def head(self) -> nn.Module:
        return self.model.get_input_embeddings()

    def input_embedding(self) -> nn.Module | None:
        return None

    def blocks(self) -> list[nn.Module]:
        names = set(getattr(self.model, "_no_split_modules", None) or ())
        return [m for m in self.model.modules() if type(m).__name__ in names]


def _plugins_for(loaded: LoadedModel, hidden_samples: int):
    """The configuration, the set-up plugins and the model handle of the text pass: causal LMs
    get all four metrics, the others ``frequency`` and ``hidden``; an encoder without a head
    reads its input embedding as the head (`_EncoderHandle`)."""
    causal = loaded.kind == "causal-lm"
    metrics = ("frequency", "eval", "hidden", "bottleneck") if causal else ("frequency", "hidden")
    config = AnisoConfig(metrics=metrics, hidden_samples=hidden_samples, group_tokens="seen", load_entry_points=False)
    plugins = AnisoPlugins(config)
    if causal or loaded.kind in ("masked-lm", "seq2seq-lm"):
        handle = OutputEmbeddingsHandle(loaded.model)
    else:
        handle = _EncoderHandle(loaded.model)
    return config, plugins, handle


def _feed(loaded: LoadedModel, plugins, batches: list[torch.Tensor], ignore_index: int, bar: Callable) -> None:
    """Every batch's targets to `aniso_targets` and (causal LMs) its logits to `aniso_eval_batch`;
    the first batch of a causal LM runs one backward in eval mode (the bottleneck probe), its
    gradients dropped afterwards."""
    model = loaded.model
    causal, seq2seq = loaded.kind == "causal-lm", loaded.kind == "seq2seq-lm"
    device = next(model.parameters()).device
    for i, x in enumerate(bar(batches, len(batches), f"{loaded.name}: text")):
        x = x.to(device)
        y = causal_targets(x, ignore_index) if causal else x  # labels as they are: masked, seq2seq
        inputs = {"input_ids": x, "labels": x} if seq2seq else {"input_ids": x}
        plugins.targets(y, StepInfo(step=1, micro_batch=i, measure=True))
        if i == 0 and causal:  # the bottleneck probe needs a backward (eval mode, grad on)
            with torch.enable_grad():
                logits = model(input_ids=x).logits
                loss = torch.nn.functional.cross_entropy(
                    logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1), ignore_index=ignore_index
                )
                loss.backward()
            model.zero_grad(set_to_none=True)
        else:
            with torch.no_grad():
                out = model(**inputs)
            logits = getattr(out, "logits", None)
        if causal:
            plugins.eval_batch(logits.detach(), y)


def _count_targets(plugins, count_ids: torch.Tensor, length: int, causal: bool, ignore_index: int) -> None:
    """Replace the counted targets by those of another text (its targets as the text's own:
    the causal shift within its `length`-token blocks), through the plugins' state hooks."""
    vocab = len(plugins.state_dict()[TARGET_COUNTS]["counts"])
    y = causal_targets(text_blocks(count_ids, length), ignore_index) if causal else count_ids
    y = y.reshape(-1)
    counts = torch.bincount(y[y != ignore_index], minlength=vocab)
    plugins.load_state_dict({TARGET_COUNTS: {"counts": counts}})


LOW_COVERAGE = 0.5
"""Below this share of the vocabulary occurring in the text, the report warns (groups of few ids)."""


def _text_metrics(train: dict, evaluation: dict, counts: torch.Tensor, group_fractions, ids: torch.Tensor,
                  blocks: torch.Tensor, from_counts_text: bool, causal: bool) -> dict[str, Any]:
    """The ``text`` entry of a model from the measured metrics and the target counts."""
    groups = frequency_groups(counts, group_fractions, seen_only=True)
    strip = lambda d, p: {k[len("aniso/" + p):]: v for k, v in d.items() if k.startswith("aniso/" + p)}  # noqa: E731
    layers = strip(train, "hidden/")
    out = {
        "tokens": int(ids.numel()),
        "sequence_length": int(blocks.shape[1]),
        "sequences": int(blocks.shape[0]),
        "counted_targets": int(counts.sum()),
        "groups_from": "counts_text" if from_counts_text else "text",
        "distinct_tokens": int((counts > 0).sum()),
        "group_sizes": {g: int((groups == i).sum()) for i, g in enumerate(GROUPS)},
        "unseen_ids": int((counts == 0).sum()),
        "coverage": float((counts > 0).sum() / counts.numel()),
        "group_token_share": {
            g: float(counts[groups == i].sum() / counts.sum().clamp_min(1)) for i, g in enumerate(GROUPS)
        },
        "frequency": strip(train, "frequency/"),
        "hidden_mean_cosine": [layers[f"layer_{i}/mean_cosine"] for i in range(len(layers))],
        "_counts": counts,
        "_groups": groups,
    }
    if out["coverage"] < LOW_COVERAGE:
        out["warning"] = (
            f"the {'counts ' if from_counts_text else ''}text holds {out['distinct_tokens']:,} of the {counts.numel():,} ids "
            f"({out['coverage']:.1%}, below {LOW_COVERAGE:.0%}): the frequency groups are of the ids it holds "
            f"({out['unseen_ids']:,} ids are in none); give a longer text or --counts-file with the training text"
        )
    if causal:
        out["eval"] = strip(evaluation, "eval/")
        out["bottleneck"] = strip(train, "bottleneck/")
    return out


def text_pass(loaded: LoadedModel, ids: torch.Tensor, *, batch_size: int = 8, hidden_samples: int = 1000,
              progress: Callable | None = None, count_ids: torch.Tensor | None = None) -> dict[str, Any]:
    """One pass over the text with the built-in plugins: frequency groups from the token counts,
    per-group perplexity and Uniq (causal LMs), hidden-state anisotropy per block, and the
    gradient-bottleneck probe on the first batch (one backward in eval mode). `count_ids`: the
    tokens whose counts define the groups instead (e.g. the training text).

    The targets follow the model's loss (`aniso_plugins.core.targets`): a causal LM predicts the
    next token; a masked LM's and an encoder's positions hold their own token; an
    encoder-decoder reads the text on both sides (encoder input and decoder labels) and is
    measured on its decoder (no perplexity: a text alone has no source-target pairs)."""
    model = loaded.model
    causal = loaded.kind == "causal-lm"
    config, plugins, handle = _plugins_for(loaded, hidden_samples)
    length = sequence_length(model)
    blocks = text_blocks(ids, length)
    was_training = model.training
    model.eval()
    plugins.setup(handle)
    try:
        _feed(loaded, plugins, list(blocks.split(batch_size)), config.ignore_index, progress or (lambda it, total, desc: it))
        plugins.step_end(StepInfo(step=1))
        if count_ids is not None:  # groups by another text's counts
            _count_targets(plugins, count_ids, length, causal, config.ignore_index)
        train = plugins.measure(StepInfo(step=1, measure=True), "train")
        evaluation = plugins.measure(StepInfo(step=1, measure=True), "eval") if causal else {}
        counts = plugins.state_dict()[TARGET_COUNTS]["counts"]
    finally:
        handle.restore()
        model.train(was_training)
    return _text_metrics(train, evaluation, counts, config.group_fractions, ids, blocks, count_ids is not None, causal)


__all__ = ["sequence_length", "text_blocks", "text_pass", "tokens"]
