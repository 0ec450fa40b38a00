"""The printed log is one readable line per logging step (issue 43): the HF Trainer's printer and
Lightning's progress bar get the plugins' summary values, the loggers and ``log_history`` every
``aniso/...`` value."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
from lightning.pytorch.loggers import CSVLogger
from transformers import Trainer, TrainingArguments
from transformers.trainer_callback import PrinterCallback

from aniso_plugins import AnisoConfig
from aniso_plugins.integrations.hf import AnisoCallback
from aniso_plugins.integrations.lightning import AnisoCallback as LightningCallback
from hf_utils import TokenDataset, tiny_gpt2
from lightning_utils import LitLM, loader
from token_data import VOCAB

CONFIG = dict(method="agg", alpha=0.03, metrics=("geometry", "frequency"), load_entry_points=False)


def test_hf_printer_prints_the_summary_and_the_loggers_get_every_value(tmp_path, capsys):
    cb = AnisoCallback(AnisoConfig(**CONFIG))
    trainer = Trainer(
        model=tiny_gpt2(), callbacks=[cb],
        args=TrainingArguments(output_dir=str(tmp_path), max_steps=2, logging_steps=1, report_to="none", use_cpu=True,
                               disable_tqdm=True, save_strategy="no", per_device_train_batch_size=4),
        train_dataset=TokenDataset(n=16, length=8, vocab=VOCAB, seed=1),
    )
    trainer.train()
    printed = [line for line in capsys.readouterr().out.splitlines() if "'loss'" in line]
    assert len(printed) == 2
    full = [r for r in trainer.state.log_history if "loss" in r]
    for line, record in zip(printed, full):
        keys = [k for k in record if k.startswith("aniso/")]
        assert len(keys) > 20  # the loggers' record keeps every value
        assert "aniso/" not in line  # the printed one none of them
        iw, cos = record["aniso/geometry/head/isotropy"], record["aniso/geometry/head/mean_cosine"]
        assert f"I(W) {iw:.4g}" in line and f"cos {cos:.4g}" in line
        assert f"+{len(keys) - 4} values in the loggers" in line  # I(W), cos, I(W) rare, AGG gated shown
    printer = next(c for c in trainer.callback_handler.callbacks if isinstance(c, PrinterCallback))
    assert "on_log" in printer.__dict__
    cb.detach()
    assert "on_log" not in printer.__dict__  # the printer as it was


def test_lightning_progress_bar_gets_the_summary_and_the_logger_every_value(tmp_path):
    trainer = pl.Trainer(accelerator="cpu", max_steps=2, log_every_n_steps=1, enable_checkpointing=False,
                         logger=CSVLogger(str(tmp_path)), enable_model_summary=False,
                         callbacks=[LightningCallback(AnisoConfig(**CONFIG), head="model.lm_head", input_embedding="model.embed",
                                                      blocks="model.blocks", targets="causal")])
    trainer.fit(LitLM(), loader())
    bar, logged = trainer.progress_bar_metrics, trainer.logged_metrics
    assert bar["I(W)"] == pytest.approx(float(logged["aniso/geometry/head/isotropy"]))
    assert bar["cos"] == pytest.approx(float(logged["aniso/geometry/head/mean_cosine"]))
    assert "I(W)" not in logged and not any(k.startswith("aniso/") for k in bar)
