"""Pickled checkpoints are read only when asked (`--trust-checkpoint`, ``trust_checkpoint=True``):
a DeepSpeed ZeRO folder whose shard runs code when unpickled is refused without the flag, and the
code does not run; a Lightning ``.ckpt`` holding an object (a ``Namespace`` of hyperparameters)
that ``weights_only=True`` cannot load is refused without it and read with it, to the same numbers
as the tensors-only checkpoint."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from aniso_plugins.offline.errors import ReportError
from aniso_plugins.offline.sources import load_model
from test_report import ref_mean_cosine
from test_report_checkpoints import _fit, _report


class _Payload:
    """Unpickling it creates the file `marker`: the stand-in for code a hostile pickle runs."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return open, (str(self.marker), "w")


def _hostile_zero_checkpoint(root: Path, marker: Path) -> Path:
    """An HF Trainer ``checkpoint-N`` laid out as DeepSpeed writes it, whose shards are `_Payload`s."""
    step = root / "checkpoint-1" / "global_step1"
    step.mkdir(parents=True)
    (step.parent / "latest").write_text("global_step1\n")
    for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"):
        torch.save({"optimizer_state_dict": _Payload(marker), "module": _Payload(marker)}, step / name)
    return step.parent


def test_a_deepspeed_checkpoint_is_not_unpickled_without_the_flag(tmp_path):
    marker = tmp_path / "the_pickle_ran"
    ckpt = _hostile_zero_checkpoint(tmp_path, marker)
    p, _ = _report(ckpt, "--out", tmp_path / "r")
    assert p.returncode == 2 and not marker.exists(), p.stderr
    (line,) = p.stderr.strip().splitlines()  # one line: the flag, why, and the safe route
    assert "--trust-checkpoint" in line and "runs any code it holds" in line
    assert f"python -m deepspeed.utils.zero_to_fp32 {ckpt} OUT -t global_step1 --safe_serialization" in line
    assert not (tmp_path / "r").exists()
    with pytest.raises(ReportError, match=r"global_step1: a DeepSpeed ZeRO checkpoint's shards are pickles; pass "
                       r"--trust-checkpoint \(trust_checkpoint=True in Python\)"):
        load_model(ckpt)
    assert not marker.exists()


def test_the_flag_lets_deepspeed_unpickle_the_shards(tmp_path):
    """With the flag the shards are loaded (the payload runs: the proof that the refusal above is
    what kept it from running); they hold no weights, so the report then fails, naming the folder."""
    pytest.importorskip("deepspeed.utils.zero_to_fp32")
    marker = tmp_path / "the_pickle_ran"
    ckpt = _hostile_zero_checkpoint(tmp_path, marker)
    with pytest.raises(ReportError, match="global_step1"):
        load_model(ckpt, trust_checkpoint=True)
    assert marker.exists()


def test_a_lightning_checkpoint_with_objects_needs_the_flag(tmp_path):
    module, ckpt = _fit(tmp_path, tied=False)
    state = torch.load(ckpt, weights_only=True)
    state["hyper_parameters"] = {"args": argparse.Namespace(lr=1e-3)}  # what save_hyperparameters(args) stores
    with_objects = tmp_path / "with_objects.ckpt"
    torch.save(state, with_objects)
    p, _ = _report(with_objects, "--out", tmp_path / "r")
    assert p.returncode == 2
    (line,) = p.stderr.strip().splitlines()
    assert "holds objects other than tensors (argparse.Namespace)" in line and "--trust-checkpoint" in line
    assert "safetensors.torch.save_file" in line
    p, data = _report(with_objects, "--out", tmp_path / "r", "--trust-checkpoint")
    assert p.returncode == 0, p.stderr
    for role, weight in (("embedding", module.model.embed.weight), ("head", module.model.lm_head.weight)):
        got = data["models"][0]["matrices"][role]["raw"]["mean_cosine"]
        assert got == pytest.approx(ref_mean_cosine(weight.detach().double().numpy()), rel=1e-6, abs=1e-9)
    assert torch.equal(load_model(with_objects, trust_checkpoint=True).matrices["head"].read(0, 2),
                       module.model.lm_head.weight.detach()[:2])


def test_the_flag_is_in_the_help():
    p = subprocess.run([sys.executable, "-m", "aniso_plugins.offline.cli", "report", "--help"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and "--trust-checkpoint" in p.stdout and "runs any code it holds" in p.stdout
