"""Train the tiny MLE and AGG GPT-2s of examples/hf_train.py, save them as Hugging Face model
directories (with a matching tokenizer), and write one side-by-side `aniso report` of both.

    python examples/report_demo.py                       # -> ./report_demo/{mle,agg,report}
    python examples/report_demo.py --images docs/images  # also copy two plots for the README

Offline: Python's help text (examples/corpus.py), a word-level tokenizer built from the same
vocabulary as the example's (`tokenizers` WordLevel), nothing downloaded. The report is then
the one command (the validation tenth of the corpus as the text):

    aniso report report_demo/mle report_demo/agg --text-file report_demo/valid.txt \\
        --counts-file report_demo/train.txt --out report_demo/report
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import torch
from comparison import METHODS, add_run_arguments
from corpus import Blocks, hf_tokenizer, load_text, split_texts, tokenize
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from aniso_plugins import AnisoConfig
from aniso_plugins.integrations.hf import AnisoCallback
from aniso_plugins.offline.report import TextOptions, analyze


def train(method: str, train_ds, vocab: int, a, out: Path) -> None:
    torch.manual_seed(a.seed)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=vocab, n_positions=a.block, n_embd=a.d_model, n_layer=a.layers,
                                       n_head=4, bos_token_id=0, eos_token_id=0))
    model.loss_type = "ForCausalLM"
    config = AnisoConfig(**METHODS[method], metrics=("geometry",))
    args = TrainingArguments(
        output_dir=str(out / f"{method}_run"), max_steps=a.steps, per_device_train_batch_size=a.batch_size,
        learning_rate=3e-3, weight_decay=0.01, warmup_steps=a.steps // 10, lr_scheduler_type="cosine",
        logging_steps=max(1, a.steps // 4), eval_strategy="no", save_strategy="no", report_to="none", use_cpu=True,
        seed=a.seed, disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=train_ds, callbacks=[AnisoCallback(config)])
    trainer.train()
    trainer.save_model(str(out / method))  # the callback's detach keeps the trained head
    shutil.rmtree(out / f"{method}_run", ignore_errors=True)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="report_demo")
    p.add_argument("--images", default=None, help="copy spectrum.png and projection.png here (README images)")
    add_run_arguments(p)
    a = p.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    text = load_text(None)
    ids, vocab = tokenize(text, a.vocab_size)
    split = int(len(ids) * 0.9)
    tok = hf_tokenizer(vocab)
    train_text, valid_text = split_texts(text)
    (out / "valid.txt").write_text(valid_text, encoding="utf-8")
    (out / "train.txt").write_text(train_text, encoding="utf-8")
    for method in ("mle", "agg"):
        train(method, Blocks(ids[:split], a.block), len(vocab), a, out)
        tok.save_pretrained(out / method)
    options = TextOptions(text_file=out / "valid.txt", counts_file=out / "train.txt")
    report = analyze([str(out / "mle"), str(out / "agg")], options, progress=sys.stderr.isatty())
    paths = report.write(out / "report")
    print(report.to_markdown())
    print("wrote", *paths, sep="\n  ")
    if a.images:
        images = Path(a.images)
        images.mkdir(parents=True, exist_ok=True)
        for name in ("spectrum.png", "projection.png", "layers.png", "norm_frequency.png", "cosines.png"):
            shutil.copy(out / "report" / name, images / f"report_{name}")
            print("copied", images / f"report_{name}")


if __name__ == "__main__":
    main()
