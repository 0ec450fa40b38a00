"""Sentence embeddings, the classic use of post-processing (BERT-whitening, Su et al. 2021;
all-but-the-top, Mu & Viswanath 2018): an encoder's pooled vectors of one text's sentences, their
geometry before and after each transform (``models[i].sentences`` of the report), and the
fitted transform saved for reuse (``aniso postprocess``).

Sentences are the text's non-empty lines (at least `MIN_SENTENCES`: with fewer, e.g. a text on
one line, the report skips its section with a note and ``aniso postprocess`` refuses). Pooling is
the model's sentence-transformers pooling when its folder has one (``modules.json`` → the Pooling
module's ``config.json``: mean or CLS), else the mean over the tokens
(`aniso_plugins.methods.simcse.contrastive.pool`)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch

from aniso_plugins.core.errors import ConfigError
from aniso_plugins.methods.simcse.contrastive import pool
from aniso_plugins.metrics.geometry.isoscore import isoscore
from aniso_plugins.metrics.geometry.stats import effective_rank, mean_cosine
from aniso_plugins.offline.errors import ReportError
from aniso_plugins.offline.output import atomic_directory, check_output_dir
from aniso_plugins.offline.postprocess import make_transform
from aniso_plugins.offline.sources import LoadedModel, MatrixSource, load_model
from aniso_plugins.offline.text_file import read_text

MIN_SENTENCES = 2
"""Sentences a text needs for their geometry (and a transform fitted on them)."""
MAX_SENTENCES = 10_000
"""Sentences embedded per text at most."""
MAX_LENGTH = 128
"""Tokens per sentence at most (the rest is cut; fewer where the model has fewer positions)."""

logger = logging.getLogger(__name__)


def sentences_of(text: str, limit: int = MAX_SENTENCES) -> list[str]:
    """The first `limit` non-empty lines of `text`, stripped."""
    return [line.strip() for line in text.splitlines() if line.strip()][:limit]


def model_pooling(path: str | Path) -> str:
    """"cls" or "mean": the sentence-transformers Pooling module's mode in the model folder
    `path` ("mean" without one, and for the modes this module does not compute: max, last token)."""
    folder = Path(path)
    modules = folder / "modules.json"
    if modules.is_file():
        for module in json.loads(modules.read_text()):
            if str(module.get("type", "")).endswith("Pooling"):
                config = folder / module.get("path", "") / "config.json"
                cfg = json.loads(config.read_text()) if config.is_file() else {}
                if cfg.get("pooling_mode") == "cls" or cfg.get("pooling_mode_cls_token"):  # v6 / v2–v5 configs
                    return "cls"
    return "mean"


def too_few_sentences(sentences: list[str]) -> str | None:
    """Why `sentences` are too few to measure (fewer than `MIN_SENTENCES`), or None."""
    if len(sentences) >= MIN_SENTENCES:
        return None
    return (f"the text gives {len(sentences)} non-empty line(s); sentence embeddings need at least {MIN_SENTENCES} "
            "(one sentence per line)")


def sentence_embeddings(loaded: LoadedModel, sentences: list[str], pooling: str, batch: int = 32) -> torch.Tensor:
    """(N, d) float32 pooled last hidden states of `sentences` (the encoder's for an
    encoder-decoder), in eval mode without gradients."""
    if loaded.model is None or loaded.tokenizer is None:
        raise ReportError(f"sentence embeddings need a model folder with its tokenizer; {loaded.path} has none")
    if (reason := too_few_sentences(sentences)) is not None:
        raise ReportError(reason)
    model, tok = loaded.model, loaded.tokenizer
    seq2seq = getattr(model.config, "is_encoder_decoder", False)
    encoder = model.get_encoder() if seq2seq else getattr(model, "base_model", model)
    device = next(model.parameters()).device
    length = min(MAX_LENGTH, getattr(model.config, "max_position_embeddings", None) or MAX_LENGTH)
    out = []
    with torch.no_grad():
        for s in range(0, len(sentences), batch):
            ids, mask = _padded([tok(x, truncation=True, max_length=length)["input_ids"] for x in sentences[s : s + batch]])
            hidden = encoder(input_ids=ids.to(device), attention_mask=mask.to(device)).last_hidden_state
            out.append(pool(hidden, mask.to(device), pooling).float().cpu())
    return torch.cat(out)


def _padded(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Token id rows as one (B, T) batch and its attention mask; the padding id is 0 and masked
    (no pad token needed, which many tokenizers lack)."""
    ids = torch.zeros(len(rows), max(len(r) for r in rows), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, : len(r)], mask[i, : len(r)] = torch.tensor(r, dtype=torch.long), 1
    return ids, mask


def sentence_entry(loaded: LoadedModel, text: str, geometry: Any) -> dict[str, Any]:
    """``models[i].sentences``: the pooling, the number of sentences and ``geometry(source)`` of
    their (N, d) embeddings (the report's matrix geometry, post-processing included). A text of
    fewer than `MIN_SENTENCES` lines (e.g. a dump on one line) gives ``{"skipped": reason}`` and
    a logged warning instead: the rest of the report does not need its sentences."""
    sentences = sentences_of(text)
    if (reason := too_few_sentences(sentences)) is not None:
        logger.warning("%s: sentence embeddings skipped: %s", loaded.name, reason)
        return {"skipped": reason}
    pooling = model_pooling(loaded.path)
    x = sentence_embeddings(loaded, sentences, pooling)
    return {"pooling": pooling, "sentences": int(x.shape[0]), "geometry": geometry(MatrixSource.of_tensor("sentences", x))}


def fit_sentence_transform(model: str | Path, text_file: str | Path | None, transform: str, out: str | Path, *,
                           k: int | None = None, pooling: str | None = None) -> list[str]:
    """``aniso postprocess``: fit `transform` on the pooled sentence embeddings of `text_file`'s
    lines and write, atomically into `out`, ``transform.safetensors`` (load it with
    `aniso_plugins.offline.postprocess.load_transform`) and ``postprocess.json`` (the settings
    and the embeddings' mean cosine, IsoScore and effective rank before and after). A causal LM
    gets `centered_head_checkpoint` instead."""
    try:
        t = make_transform(transform, k)
    except ConfigError as e:
        raise ReportError(str(e)) from None
    check_output_dir(out)
    loaded = load_model(model, need_model=True)
    if loaded.kind == "causal-lm":
        return centered_head_checkpoint(loaded, t, out)
    if text_file is None:
        raise ReportError(f"{model} is a {loaded.kind}: its sentence embeddings need --text-file (one sentence per line)")
    pooling = pooling or model_pooling(loaded.path)
    x = sentence_embeddings(loaded, sentences_of(read_text(text_file, "text file")), pooling).double()
    t.fit(x, distributed=False)
    y = t.transform(x)
    summary = {
        "model": str(model), "text_file": str(text_file), "pooling": pooling, "transform": t.kind, "params": t.params,
        "sentences": int(x.shape[0]), "dim": int(x.shape[1]), "out_dim": int(y.shape[1]),
        "before": _summary(x), "after": _summary(y),
    }
    with_module = _sentence_transformers_writer(Path(loaded.path), summary)
    with atomic_directory(out) as tmp:
        t.save(tmp / "transform.safetensors")
        if with_module is not None:
            with_module(Path(loaded.path), t, tmp / "sentence_transformer")
        (tmp / "postprocess.json").write_text(json.dumps(summary, indent=1) + "\n")
    names = ["transform.safetensors", "postprocess.json"] + (["sentence_transformer"] if with_module else [])
    return [str(Path(out) / n) for n in names]


def _sentence_transformers_writer(folder: Path, summary: dict[str, Any]):
    """`aniso_plugins.offline.sentence_module.with_transform` for a sentence-transformers model
    folder when that package is installed (noted in `summary` when it is not), else None."""
    if not (folder / "modules.json").is_file():
        return None
    try:
        from aniso_plugins.offline.sentence_module import with_transform  # the optional sentence-transformers
    except ImportError:
        summary["sentence_transformer"] = "not written: pip install sentence-transformers"
        return None
    summary["sentence_transformer"] = ("sentence_transformer/: SentenceTransformer(path, trust_remote_code=True).encode "
                                       "gives the transformed vectors")
    return with_transform


def centered_head_checkpoint(loaded: LoadedModel, transform: Any, out: str | Path) -> list[str]:
    """A causal LM with its untied head's rows centred (w_i − μ), as a new Hugging Face model
    folder: every logit moves by the same −μ·h, so the probabilities do not change (measured:
    ``max_logprob_change`` in ``postprocess.json``, on random token ids). Only centring is exact;
    a tied head would change the input embedding too."""
    model = loaded.model
    if transform.kind != "centering":
        raise ReportError(f"--transform {transform.kind}: for a causal LM only centering keeps the model's probabilities "
                          "(it writes the centred head as a new checkpoint); the others change the logits")
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    if head is None or head.weight.data_ptr() == embed.weight.data_ptr():
        raise ReportError(f"{loaded.path}: the LM head is tied to the input embedding, so centring it would change the "
                          "inputs too; untie it first (AnisoConfig(head='untie') while training)")
    ids = torch.randint(0, embed.weight.shape[0], (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = torch.log_softmax(model(input_ids=ids).logits.double(), -1)
        mean = head.weight.double().mean(0)
        head.weight.sub_(mean.to(head.weight.dtype))
        after = torch.log_softmax(model(input_ids=ids).logits.double(), -1)
    summary = {"model": loaded.path, "transform": "centering", "head_mean_norm": float(mean.norm()),
               "max_logprob_change": float((after - before).abs().max())}
    with atomic_directory(out) as tmp:
        model.save_pretrained(tmp)
        if loaded.tokenizer is not None:
            loaded.tokenizer.save_pretrained(tmp)
        (tmp / "postprocess.json").write_text(json.dumps(summary, indent=1) + "\n")
    return [str(Path(out)), str(Path(out) / "postprocess.json")]


def _summary(x: torch.Tensor) -> dict[str, float]:
    return {"mean_cosine": mean_cosine(x), "isoscore": isoscore(x), "effective_rank": effective_rank(x)}


__all__ = [
    "MAX_LENGTH",
    "MAX_SENTENCES",
    "MIN_SENTENCES",
    "centered_head_checkpoint",
    "fit_sentence_transform",
    "model_pooling",
    "sentence_embeddings",
    "sentence_entry",
    "sentences_of",
    "too_few_sentences",
]
