"""Train a tiny GPT-2 from scratch with the HF Trainer and one AnisoCallback, offline.

    python examples/hf_train.py --method agg          # AGG (Yu et al. 2022)
    python examples/hf_train.py --method mle          # plain maximum likelihood, for comparison
    python examples/hf_train.py --method cosreg|spectrum|lowrank|hinge|simctg|uniformity|agg+simctg
    python examples/hf_train.py --text-file my.txt    # your own corpus
    python examples/hf_train.py --output-dir runs/agg # also saves the model, its tokenizer and valid.txt

The default corpus is the help text that ships with every Python (``pydoc_data.topics``,
~465k characters) with a word-level vocabulary (examples/corpus.py); nothing is downloaded.
At the end it prints validation perplexity per frequency group, Uniq, I(W) and mean cosine.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path

import torch
from comparison import METHODS, MLE_AT_DEFAULTS, add_run_arguments, print_table
from corpus import hf_tokenizer, load_text, split_texts, tokenize, train_valid
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
from transformers.trainer_callback import PrinterCallback

from aniso_plugins import AnisoConfig
from aniso_plugins.integrations.hf import AnisoCallback


def main(argv: list[str] | None = None) -> dict[str, float]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--method", choices=sorted(METHODS), default="agg")
    p.add_argument("--text-file", default=None, help="train on this UTF-8 text instead of Python's help topics")
    add_run_arguments(p)
    p.add_argument("--output-dir", default=None)
    a = p.parse_args(argv)
    trainer, metrics, vocab, tokens = train(METHODS[a.method], a, prefix=f"aniso_hf_{a.method}_")
    defaults = vars(p.parse_args(["--method", a.method])) == vars(a)
    baseline = MLE_AT_DEFAULTS if defaults and a.method != "mle" else None
    print_table(f"{a.method}: vocabulary {vocab}, {tokens} training tokens", metrics, "eval_", baseline,
                "MLE (stored)")
    if not defaults and a.method != "mle":
        print("  the MLE baseline at these settings: the same command with --method mle")
    return metrics


def train(method: dict, a: argparse.Namespace, prefix: str = "aniso_hf_", disable_tqdm: bool = False):
    """Train the example's tiny GPT-2 with the `AnisoConfig` fields `method` under the run
    arguments `a` (`add_run_arguments`, plus ``text_file`` and ``output_dir``); returns the
    Trainer, the final metrics (`final_table`), the vocabulary size and the training tokens."""
    torch.manual_seed(a.seed)
    train_ds, valid_ds, vocab = train_valid(a.text_file, a.vocab_size, a.block)

    model = GPT2LMHeadModel(
        GPT2Config(
            vocab_size=vocab, n_positions=a.block, n_embd=a.d_model, n_layer=a.layers, n_head=4,
            bos_token_id=0, eos_token_id=0,
        )
    )
    model.loss_type = "ForCausalLM"  # so the Trainer normalizes by the shifted-label count, as the loss does
    # AGG's window K defaults to one epoch of optimizer steps, which the callback reads off the Trainer
    config = AnisoConfig(**{"metrics": ("geometry", "frequency", "eval", "uniformity"), **method})
    output_dir = a.output_dir or tempfile.mkdtemp(prefix=prefix)  # removed below unless --output-dir
    args = TrainingArguments(
        output_dir=output_dir, max_steps=a.steps, per_device_train_batch_size=a.batch_size,
        per_device_eval_batch_size=a.batch_size, learning_rate=3e-3, weight_decay=0.01, warmup_steps=a.steps // 10,
        lr_scheduler_type="cosine", logging_steps=max(1, a.steps // 8), eval_strategy="no", save_strategy="no",
        report_to="none", use_cpu=True, seed=a.seed, disable_tqdm=disable_tqdm,
    )
    trainer = Trainer(
        model=model, args=args, train_dataset=train_ds, eval_dataset=valid_ds, callbacks=[AnisoCallback(config)]
    )
    if disable_tqdm:  # a caller that prints its own line per run: no log records on stdout either
        trainer.remove_callback(PrinterCallback)
    try:
        trainer.train()
        metrics = final_table(trainer, trainer.evaluate())
    finally:
        if not a.output_dir:  # save_strategy="no": nothing was written there
            shutil.rmtree(output_dir, ignore_errors=True)
    if a.output_dir:  # what `aniso report` reads: the trained model, its tokenizer, the validation text
        save_for_report(trainer, a, output_dir)
    return trainer, metrics, vocab, len(train_ds) * a.block


def save_for_report(trainer: Trainer, a: argparse.Namespace, output_dir: str) -> None:
    """The final model and the word tokenizer into `output_dir` (a Hugging Face model folder),
    and the validation text as ``output_dir/valid.txt``."""
    text = load_text(a.text_file)
    trainer.save_model(output_dir)
    hf_tokenizer(tokenize(text, a.vocab_size)[1]).save_pretrained(output_dir)
    Path(output_dir, "valid.txt").write_text(split_texts(text)[1], encoding="utf-8")


def final_table(trainer: Trainer, eval_metrics: dict[str, float]) -> dict[str, float]:
    """The example's result: evaluation metrics plus the last logged geometry."""
    last = {}
    for row in trainer.state.log_history:
        last.update({k: v for k, v in row.items() if k.startswith("aniso/")})
    return {**last, **eval_metrics}


if __name__ == "__main__":
    main()
