"""`aniso report` on the checkpoints the other trainers write: a Lightning .ckpt from a real
lightning.Trainer (tied and untied heads, parameter names given or found), numbers against
numpy on the module's own weights. (torchtitan's DCP folders: tests/test_torchtitan.py.)"""

from __future__ import annotations

import json
import subprocess
import sys

import lightning.pytorch as pl
import numpy as np
import pytest

from aniso_plugins import AnisoConfig
from aniso_plugins.integrations.lightning import AnisoCallback
from lightning_utils import LitLM, loader
from test_report import ref_effective_rank, ref_mean_cosine

PATHS = dict(head="model.lm_head", input_embedding="model.embed", blocks="model.blocks", targets="causal")


def _fit(tmp_path, tied: bool):
    cb = AnisoCallback(AnisoConfig(method="agg", metrics=(), load_entry_points=False), **PATHS)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=str(tmp_path), num_sanity_val_steps=0,
                         callbacks=[cb])
    module = LitLM(tied=tied)
    trainer.fit(module, loader())
    (ckpt,) = (tmp_path / "checkpoints").glob("*.ckpt")
    return module, ckpt


def _report(*args):
    p = subprocess.run([sys.executable, "-m", "aniso_plugins.offline.cli", "report", *map(str, args), "--quiet",
                        "--no-plots", "--json"], capture_output=True, text=True, timeout=300)
    return p, (json.loads(p.stdout) if p.returncode == 0 else None)


@pytest.mark.parametrize("tied", [True, False])
def test_a_lightning_checkpoint_is_reported_from_its_state_dict(tmp_path, tied):
    module, ckpt = _fit(tmp_path, tied)
    p, data = _report(ckpt, "--out", tmp_path / "r")
    assert p.returncode == 0, p.stderr
    m = data["models"][0]
    assert m["kind"] == "lightning" and m["tied"] is tied
    assert set(m["matrices"]) == ({"embedding"} if tied else {"embedding", "head"})
    for role, weight in (("embedding", module.model.embed.weight), ("head", module.model.lm_head.weight)):
        if role in m["matrices"]:
            w = weight.detach().double().numpy()
            assert m["matrices"][role]["raw"]["mean_cosine"] == pytest.approx(ref_mean_cosine(w), rel=1e-6, abs=1e-9)
            assert m["matrices"][role]["centered"]["effective_rank"] == pytest.approx(ref_effective_rank(w), rel=1e-6)
    assert m["under_trained"]["candidates"]  # no tokenizer: ranked by the input norm
    norms = np.linalg.norm(module.model.embed.weight.detach().double().numpy(), axis=1)
    assert m["under_trained"]["candidates"][0]["id"] == int(norms.argmin())


def test_lightning_parameter_names_can_be_given_and_a_wrong_one_is_named(tmp_path):
    module, ckpt = _fit(tmp_path, tied=False)
    p, data = _report(ckpt, "--out", tmp_path / "r", "--embedding", "model.lm_head.weight", "--head", "model.embed.weight")
    assert p.returncode == 0, p.stderr
    w = module.model.lm_head.weight.detach().double().numpy()
    assert data["models"][0]["matrices"]["embedding"]["raw"]["mean_cosine"] == pytest.approx(ref_mean_cosine(w), rel=1e-6)
    p, _ = _report(ckpt, "--out", tmp_path / "r2", "--head", "model.nothere")
    assert p.returncode == 2 and "no 2-D floating-point tensor 'model.nothere' for --head" in p.stderr
    assert "model.embed.weight" in p.stderr  # the listing of what there is
    p, _ = _report(ckpt, "--out", tmp_path / "r3", "--text-file", __file__)
    assert p.returncode == 2 and "needs a Hugging Face model folder" in p.stderr
