"""Smoke tests of the package as a user installs it: run by `.ci/run` with the interpreter of a
fresh virtual environment that holds the built wheel (no source tree on ``sys.path``).

    python tests/installed_smoke.py STAGE [STAGE ...]    # core hf report postprocess trl lightning torchtitan liger

Each stage needs the extras installed before it (`.ci/run` adds them one group at a time, so a
stage also proves that its extra pulls in what it imports): ``core`` the bare wheel, ``hf`` and
``report`` and ``postprocess`` ``[hf,report,sentences]``, ``trl``, ``lightning`` and
``torchtitan`` and ``liger`` ``[trl,lightning,torchtitan,liger]`` (with the first group, in one resolution). Every stage writes under ``$ANISO_SMOKE_DIR`` (default: a new
temporary folder); ``hf`` saves the tiny checkpoints the ``report`` and ``postprocess`` stages
read. Nothing is downloaded: the models are built from configs, the text is Python's own help
topics. Exit 0 when every stage passed; a failing stage raises.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
WORK = Path(os.environ.get("ANISO_SMOKE_DIR") or tempfile.mkdtemp(prefix="aniso-smoke-"))
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
VOCAB = 300


def _aniso(*args: str) -> subprocess.CompletedProcess:
    """The installed ``aniso`` console script (the one in this interpreter's scripts folder)."""
    exe = Path(sysconfig.get_path("scripts")) / "aniso"
    proc = subprocess.run([str(exe), *args], capture_output=True, text=True, env=ENV, cwd=WORK, timeout=600)
    assert proc.returncode == 0, f"aniso {' '.join(args)} exited {proc.returncode}:\n{proc.stderr[-3000:]}"
    return proc


def _text() -> str:
    import pydoc_data.topics

    topics = pydoc_data.topics.topics
    return "\n\n".join(topics[k] for k in sorted(topics))[:60_000]


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tk.train_from_iterator([_text()], trainers.WordLevelTrainer(vocab_size=VOCAB, special_tokens=["<unk>", "<pad>"]))
    return PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", pad_token="<pad>")


def _blocks(ids: list[int], length: int = 16):
    import torch

    n = len(ids) // length * length
    return torch.tensor(ids[:n]).view(-1, length)


def stage_core() -> None:
    """The wheel, not the source tree, is imported; every module of the tree was installed; the
    version is the same everywhere; the core runs without any trainer installed."""
    import importlib.metadata

    import aniso_plugins
    from aniso_plugins import AnisoConfig

    installed = Path(aniso_plugins.__file__).resolve().parent
    assert not installed.is_relative_to(ROOT), f"imported the source tree ({installed}), not the wheel"
    assert installed.parent == Path(sysconfig.get_path("purelib")).resolve(), installed
    tree = {p.relative_to(ROOT / "aniso_plugins").as_posix() for p in (ROOT / "aniso_plugins").rglob("*.py")}
    tree |= {f"integrations/{p.relative_to(ROOT / 'integrations').as_posix()}" for p in (ROOT / "integrations").rglob("*.py")}
    got = {p.relative_to(installed).as_posix() for p in installed.rglob("*.py")}
    assert tree == got, f"installed modules differ from the tree: missing {sorted(tree - got)}, extra {sorted(got - tree)}"
    assert (installed / "py.typed").is_file(), "py.typed is not installed"
    version = importlib.metadata.version("aniso-plugins")
    assert aniso_plugins.__version__ == version, (aniso_plugins.__version__, version)
    assert _aniso("--version").stdout.strip() == f"aniso {version}"
    config = AnisoConfig(method="agg", metrics=("geometry",))
    assert config.replace(alpha=0.05).alpha == 0.05


def stage_hf() -> None:
    """A real ``transformers.Trainer``, AGG (fused, the default) and two metrics for 2 steps on a
    tiny Llama; the metrics reach the Trainer's log; the model, its tokenizer and a tiny BERT
    encoder are saved for the report stages."""
    import torch
    from transformers import BertConfig, BertModel, LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

    from aniso_plugins import AnisoConfig
    from aniso_plugins.integrations.hf import AnisoCallback

    tok = _tokenizer()
    blocks = _blocks(tok(_text())["input_ids"])
    data = [{"input_ids": b, "labels": b} for b in blocks[:64]]
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=False))
    args = TrainingArguments(output_dir=str(WORK / "hf_run"), max_steps=2, per_device_train_batch_size=8,
                             logging_steps=1, report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True)
    config = AnisoConfig(method="agg", metrics=("geometry", "frequency"))
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[AnisoCallback(config)])
    trainer.train()
    logged = [r for r in trainer.state.log_history if "loss" in r]
    assert len(logged) == 2, trainer.state.log_history
    for record in logged:
        assert record["aniso/geometry/head/mean_cosine"] == record["aniso/geometry/head/mean_cosine"], record
        assert any(k.startswith("aniso/frequency/") for k in record), sorted(record)
    model.save_pretrained(WORK / "llama")
    tok.save_pretrained(WORK / "llama")
    (WORK / "text.txt").write_text(_text(), encoding="utf-8")
    bert = BertModel(BertConfig(vocab_size=len(tok), hidden_size=24, num_hidden_layers=1, num_attention_heads=2,
                                intermediate_size=48, max_position_embeddings=64))
    bert.save_pretrained(WORK / "bert")
    tok.save_pretrained(WORK / "bert")


def stage_trl() -> None:
    """TRL's ``SFTTrainer`` with AGG for 2 steps on a tiny Llama and the Python help text: the
    head answers TRL's fused LM head chunk by chunk and the metrics reach TRL's log beside its own."""
    import torch
    from datasets import Dataset
    from transformers import LlamaConfig, LlamaForCausalLM
    from trl import SFTConfig, SFTTrainer

    from aniso_plugins import AnisoConfig
    from aniso_plugins.integrations.hf import AnisoCallback

    tok = _tokenizer()
    tok.eos_token = "<pad>"
    lines = [line for line in _text().splitlines() if len(line.split()) > 4][:64]
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False))
    args = SFTConfig(output_dir=str(WORK / "trl_run"), max_steps=2, per_device_train_batch_size=8, logging_steps=1,
                     report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True, bf16=False, max_length=32)
    trainer = SFTTrainer(model=model, args=args, train_dataset=Dataset.from_dict({"text": lines}), processing_class=tok,
                         callbacks=[AnisoCallback(AnisoConfig(method="agg", metrics=("geometry",)))])
    trainer.train()
    logged = [r for r in trainer.state.log_history if "loss" in r]
    assert len(logged) == 2 and all("aniso/geometry/head/isotropy" in r and "entropy" in r for r in logged), logged


def stage_liger() -> None:
    """``use_liger_kernel=True`` with AGG for one step on a tiny Llama: Liger's fused linear
    cross-entropy is set aside and the fused loss trains (Liger's other kernels off: no Triton
    kernel runs without a GPU)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

    from aniso_plugins import AnisoConfig
    from aniso_plugins.integrations.hf import AnisoCallback

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False))
    ids = torch.randint(0, 64, (8, 16), generator=torch.Generator().manual_seed(0))
    kernels = {"fused_linear_cross_entropy": True, "rope": False, "rms_norm": False, "swiglu": False, "cross_entropy": False}
    args = TrainingArguments(output_dir=str(WORK / "liger_run"), max_steps=1, per_device_train_batch_size=8, report_to=[],
                             use_cpu=True, save_strategy="no", disable_tqdm=True, use_liger_kernel=True,
                             liger_kernel_config=kernels, logging_steps=1)
    callback = AnisoCallback(AnisoConfig(method="agg", metrics=("geometry",)))
    trainer = Trainer(model=model, args=args, train_dataset=[{"input_ids": r, "labels": r} for r in ids],
                      callbacks=[callback])
    assert callback.session.head_computes_loss and not args.liger_kernel_config["fused_linear_cross_entropy"]
    trainer.train()
    assert any("aniso/geometry/head/isotropy" in r for r in trainer.state.log_history)


def stage_report() -> None:
    """``aniso report`` on the saved checkpoint with the text: report.json, report.md, plots."""
    out = WORK / "report"
    _aniso("report", str(WORK / "llama"), "--text-file", str(WORK / "text.txt"), "--out", str(out), "--quiet",
           "--max-tokens", "3000")
    report = json.loads((out / "report.json").read_text())
    (model,) = report["models"]
    assert model["kind"] == "causal-lm" and model["text"]["eval"]["ppl"] > 1, model.get("text")
    assert (out / "report.md").is_file() and list(out.glob("*.png")), sorted(os.listdir(out))


def stage_postprocess() -> None:
    """``aniso postprocess`` fits BERT-whitening on the encoder's sentence embeddings and saves it."""
    lines = [x.strip() for x in _text().splitlines() if len(x.split()) > 3][:120]
    (WORK / "lines.txt").write_text("\n".join(lines), encoding="utf-8")
    out = WORK / "whitening"
    _aniso("postprocess", str(WORK / "bert"), "--text-file", str(WORK / "lines.txt"), "--transform", "whitening",
           "--k", "8", "--out", str(out))
    summary = json.loads((out / "postprocess.json").read_text())
    assert (summary["sentences"], summary["out_dim"]) == (len(lines), 8), summary
    assert (out / "transform.safetensors").is_file()


def stage_lightning() -> None:
    """A real ``lightning.Trainer`` with the callback, AGG and geometry, 2 steps on a plain model."""
    import lightning.pytorch as pl
    import torch
    import torch.nn.functional as F
    from torch import nn

    from aniso_plugins import AnisoConfig
    from aniso_plugins.integrations.lightning import AnisoCallback

    class LM(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(64, 16)
            self.lm_head = nn.Linear(16, 64, bias=False)

        def training_step(self, batch, batch_idx):
            logits = self.lm_head(torch.tanh(self.embed(batch["input_ids"])))
            return F.cross_entropy(logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten())

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    torch.manual_seed(0)
    ids = torch.randint(0, 64, (16, 8))
    loader = torch.utils.data.DataLoader([{"input_ids": x, "labels": x} for x in ids], batch_size=4)
    metrics: list[dict] = []

    class Record(pl.Callback):
        def on_train_batch_end(self, trainer, *args) -> None:
            metrics.append(dict(trainer.callback_metrics))

    callback = AnisoCallback(AnisoConfig(method="agg", metrics=("geometry",)), head="lm_head",
                             input_embedding="embed", targets="causal")
    trainer = pl.Trainer(max_steps=2, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=1,
                         callbacks=[callback, Record()], default_root_dir=str(WORK / "lightning"))
    trainer.fit(LM(), loader)
    assert trainer.global_step == 2
    assert any("aniso/geometry/head/mean_cosine" in m for m in metrics), metrics[-1:]


def stage_torchtitan() -> None:
    """torchtitan's real Trainer on the CPU (the tests' launcher), the aniso recipe with AGG and
    geometry, 1 step, its TensorBoard log holding the metric."""
    sys.path.insert(0, str(HERE))
    from torchtitan_data import write_assets

    assets = write_assets(str(WORK / "tt_assets"), seq_len=32, n_docs=16, local_batch=2, worlds=(1,))
    folder = WORK / "torchtitan"
    cmd = [sys.executable, str(HERE / "torchtitan_launcher.py"), "--module", "torchtitan_launcher", "--config",
           "cpu_aniso", "--hf_assets_path", assets["tokenizer"], "--dataloader.dataset_path", assets["data_w1"],
           "--dump_folder", str(folder), "--training.steps", "1", "--aniso.method", "agg",
           "--aniso.metrics", "geometry", "--aniso.window", "4"]
    env = {**ENV, "HF_DATASETS_CACHE": str(WORK / "hf_cache"), "PYTHONPATH": str(HERE)}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=WORK, timeout=600)
    assert proc.returncode == 0, f"torchtitan exited {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (events,) = {p.parent for p in folder.rglob("events.out.tfevents.*")}
    tags = EventAccumulator(str(events)).Reload().Tags()["scalars"]
    assert any(t.startswith("aniso/geometry/head/") for t in tags), tags


STAGES = {"core": stage_core, "hf": stage_hf, "report": stage_report, "postprocess": stage_postprocess, "liger": stage_liger,
          "trl": stage_trl, "lightning": stage_lightning, "torchtitan": stage_torchtitan}


def main(names: list[str]) -> int:
    unknown = [n for n in names if n not in STAGES]
    if not names or unknown:
        print(f"usage: installed_smoke.py STAGE [STAGE ...] with STAGE in {', '.join(STAGES)}; got {unknown or 'none'}",
              file=sys.stderr)
        return 2
    WORK.mkdir(parents=True, exist_ok=True)
    for name in names:
        start = time.perf_counter()
        STAGES[name]()
        print(f"installed package: {name} ok ({time.perf_counter() - start:.1f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
