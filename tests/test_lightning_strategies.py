"""The Lightning adapter under Lightning's FSDPStrategy (FSDP1) and DeepSpeedStrategy (ZeRO-1/2/3,
offloaded), two gloo CPU processes (`lightning_utils.cpu_strategy`), against one process on the
same global batches; and what it refuses at set-up."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import lightning.pytorch as pl
import pytest
import torch

from aniso_plugins import AnisoConfig, SetupError
from aniso_plugins.integrations.lightning import AnisoCallback
from lightning_utils import DIM, STRATEGIES, LitLM, TinyLM, loader
from token_data import VOCAB

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "lightning_strategy_script.py")
ACCUMULATION = 2


def run_script(out: str, mode: str, *options: str) -> dict:
    """Run lightning_strategy_script.py with ACCUMULATION micro-batches per step; its record."""
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu",
               PYTHONPATH=os.pathsep.join([HERE, os.path.join(HERE, "..", "examples")]))  # fmt: skip
    command = [sys.executable, SCRIPT, mode, out, "--accumulate", str(ACCUMULATION), *options]
    proc = subprocess.run(command, env=env, timeout=300, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(out) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> dict:
    return run_script(str(tmp_path_factory.mktemp("single") / "single.json"), "single")


@pytest.mark.slow
@pytest.mark.parametrize("mode", [*STRATEGIES, "zero2_fp16"])
def test_strategy_equals_one_process(tmp_path, single, mode):
    """AGG, a loss term and the geometry and frequency metrics, under accumulation: the plugins'
    counters, every logged ``aniso/...`` value and the trained weights are one process's (a loss
    term counted once per rank, or metrics read from a rank's shard, would move them); zero2_fp16:
    DeepSpeed's fp16 with a static loss scale of 128 (the terms scaled as the loss), to fp16's
    precision."""
    strategy, fp16 = mode.removesuffix("_fp16"), mode.endswith("_fp16")
    options = ["--fp16-loss-scale", "128"] if fp16 else []
    if strategy.startswith("zero"):
        # Lightning divides the loss by accumulate_grad_batches and DeepSpeed's backward once
        # more: every gradient is 1/ACCUMULATION of one process's, and SGD at ACCUMULATION
        # times the learning rate takes the same steps, with the loss terms as heavy as the loss
        options += ["--lr", str(0.1 * ACCUMULATION)]
    run = run_script(str(tmp_path / f"{mode}.json"), strategy, *options)

    # the engine really partitioned what it partitions (ZeRO-1/2 keep the weights whole)
    if strategy.startswith("zero"):
        assert run["engine"] == "DeepSpeedEngine" and run["zero_stage"] == int(strategy[4])
        assert run["offloaded"] == strategy.endswith("offload")
    else:
        assert run["engine"] == "FullyShardedDataParallel"
    if strategy.startswith(("zero3", "fsdp1")):
        assert max(run["head_elements"]) < VOCAB * DIM == max(single["head_elements"])

    rel, atol = (1e-2, 1e-2) if fp16 else (1e-5, 1e-6)  # fp16: DeepSpeed's half-precision forward
    assert run["state"].keys() == single["state"].keys()
    for name, value in single["state"].items():
        assert run["state"][name] == pytest.approx(value, rel=rel, abs=atol), name
    assert run["metrics"].keys() == single["metrics"].keys() == {"1", "2", "3"}
    for step, metrics in single["metrics"].items():
        assert any(k.startswith("aniso/geometry/") for k in metrics) and any(k.startswith("aniso/frequency/") for k in metrics)
        assert run["metrics"][step].keys() == metrics.keys()
        for name, value in metrics.items():
            assert run["metrics"][step][name] == pytest.approx(value, rel=rel, abs=atol), (step, name)
    assert run["weights"].keys() == single["weights"].keys()
    for name, value in single["weights"].items():
        torch.testing.assert_close(torch.tensor(run["weights"][name]), torch.tensor(value), rtol=atol, atol=atol, msg=name)


def test_a_model_built_in_configure_model_is_refused_at_setup(tmp_path):
    class BuiltLate(LitLM):
        def __init__(self):
            pl.LightningModule.__init__(self)
            self.lr = 0.1

        def configure_model(self):
            if not hasattr(self, "model"):
                self.model = TinyLM()

    cb = AnisoCallback(AnisoConfig(metrics=(), load_entry_points=False), head="model.lm_head",
                       input_embedding="model.embed", targets="causal")  # fmt: skip
    trainer = pl.Trainer(accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[cb],
                         default_root_dir=str(tmp_path))  # fmt: skip
    with pytest.raises(SetupError, match="no submodule 'model.lm_head'.*sets up before configure_model.*__init__"):
        trainer.fit(BuiltLate(), loader())
    assert cb.session.handle is None
