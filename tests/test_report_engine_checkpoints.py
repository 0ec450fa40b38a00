"""`aniso report` on the checkpoints the HF Trainer writes under DeepSpeed ZeRO-3 and ZeRO-2 (ZeRO
shards, consolidated by DeepSpeed's zero_to_fp32) and under accelerate's FSDP2 with
``SHARDED_STATE_DICT`` (a DCP folder, ``pytorch_model_fsdp_0``): real 2-process runs of
tests/hf_engine_script.py, whose gathered final weights (``weights.safetensors``) are the reference
for ``checkpoint-4``; a ZeRO-3 run with the low-rank head (its head reported as A·B of the
consolidated factors); and the errors of an incomplete DeepSpeed checkpoint."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from aniso_plugins.offline.errors import ReportError
from aniso_plugins.offline.sources import load_model
from test_report import ref_mean_cosine
from test_report_checkpoints import _report
from test_report_lowrank import AB_NOTE, assert_head, ref_product

pytestmark = pytest.mark.slow

HERE = Path(__file__).resolve().parent
RUNS = {"zero3": "agg_untied", "zero2": "none", "fsdp2_sharded": "agg_untied"}
"""Engine -> hf_engine_script configuration: an untied head (two matrices) under ZeRO-3 and FSDP2,
the tied one (DeepSpeed records the head as a shared parameter) under ZeRO-2."""
INNER = {"zero3": "global_step4", "zero2": "global_step4", "fsdp2_sharded": "pytorch_model_fsdp_0"}
"""The folder inside ``checkpoint-4`` that holds the engine's shards (also accepted as MODEL)."""
NAMES = {"embedding": "model.embed_tokens.weight", "head": "lm_head.weight"}
TRUST = {True: ("--trust-checkpoint",), False: ()}
"""The flag a ZeRO checkpoint (pickled shards) needs; a DCP folder needs none."""


def _train(out: Path, engine: str, run: str | None = None, save: int = 2) -> Path:
    """hf_engine_script on 2 gloo processes (the configuration `run`, default ``RUNS[engine]``),
    checkpointing every `save` steps (2: at steps 2 and 4); its run folder."""
    run = run or RUNS[engine]
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu",
               PYTHONPATH=os.pathsep.join([str(HERE), str(HERE.parent / "examples"), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(HERE / "hf_engine_script.py"), str(out), engine, run, "--save", str(save)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{' '.join(cmd)} exited {done.returncode}:\n{done.stderr[-6000:]}"
    return out / run


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Callable[[str], Path]:
    """engine -> its run folder (``run/checkpoint-{2,4}``, ``weights.safetensors``), trained on
    first use: one 2-process run per engine (and per xdist worker that needs it)."""
    root = tmp_path_factory.mktemp("engines")
    done: dict[str, Path] = {}

    def get(engine: str) -> Path:
        if engine not in done:
            done[engine] = _train(root / engine, engine)
        return done[engine]

    return get


def _numbers(entry: dict) -> dict:
    """A report.json matrix entry's statistics: the scalars, raw and centred, and the spectra."""
    scalars = {k: v for k, v in entry.items() if isinstance(v, (int, float, str))}
    spectra = {f"{k}[{i}]": x for k in ("spectrum", "spectrum_centered") for i, x in enumerate(entry[k])}
    return scalars | {f"{r}.{k}": v for r in ("raw", "centered") for k, v in entry[r].items()} | spectra


@pytest.mark.parametrize("engine", list(RUNS))
def test_a_checkpoint_is_reported_as_its_gathered_weights(trained, tmp_path, engine):
    run = trained(engine)
    ckpt = run / "run" / "checkpoint-4"
    weights = load_file(run / "weights.safetensors")
    tied = RUNS[engine] == "none"
    assert (ckpt / INNER[engine]).is_dir(), sorted(os.listdir(ckpt))  # the script saved the engine's shards
    assert (ckpt / "model.safetensors").exists() is (engine == "zero2")  # ZeRO-3 saved no HF weights
    # one report: checkpoint-4, the shard folder in it, and the gathered weights (their tensor names)
    p, data = _report(ckpt, ckpt / INNER[engine], run / "weights.safetensors", "--out", tmp_path / "r",
                      *TRUST[engine.startswith("zero")])
    assert p.returncode == 0, p.stderr
    from_ckpt, from_inner, gathered = data["models"]
    assert from_ckpt["kind"] == from_inner["kind"] == ("dcp" if engine.startswith("fsdp") else "deepspeed")
    assert from_ckpt["path"] == from_inner["path"] == str(ckpt / INNER[engine])  # zero2: the shards, not model.safetensors
    assert from_ckpt["tied"] is tied and set(from_ckpt["matrices"]) == ({"embedding"} if tied else set(NAMES))
    for role, entry in from_ckpt["matrices"].items():
        expected = _numbers(gathered["matrices"][NAMES[role]])
        for got in (_numbers(entry), _numbers(from_inner["matrices"][role])):
            assert got.keys() == expected.keys()
            for key, value in expected.items():
                assert got[key] == (value if isinstance(value, str) else pytest.approx(value, rel=1e-6, abs=1e-9)), key
        w = weights[NAMES[role]].double().numpy()
        assert entry["raw"]["mean_cosine"] == pytest.approx(ref_mean_cosine(w), rel=1e-6, abs=1e-9)
    for path in (ckpt, ckpt / INNER[engine]):
        loaded = load_model(path, trust_checkpoint=True)
        assert loaded.tied is tied and set(loaded.matrices) == set(from_ckpt["matrices"])
        for role, source in loaded.matrices.items():
            assert torch.equal(source.read(0, source.shape[0]), weights[NAMES[role]]), (path, role)


def test_a_zero3_checkpoint_of_a_low_rank_run_reports_a_times_b(tmp_path):
    """hf_engine_script's "lowrank" configuration (AnisoConfig(head="lowrank", lowrank_rank=4))
    under ZeRO-3: the shards hold lm_head.A and lm_head.B, no lm_head.weight (before issue #53 the
    report had no head); the head is their product, against the gathered factors in float64."""
    run = _train(tmp_path / "zero3_lowrank", "zero3", run="lowrank", save=4)
    ckpt = run / "run" / "checkpoint-4"
    weights = load_file(run / "weights.safetensors")
    assert {"lm_head.A", "lm_head.B"} <= set(weights) and "lm_head.weight" not in weights
    w = ref_product(weights["lm_head.A"], weights["lm_head.B"])
    p, data = _report(ckpt, ckpt / "global_step4", "--out", tmp_path / "r", "--trust-checkpoint")
    assert p.returncode == 0, p.stderr
    for m in data["models"]:
        assert m["kind"] == "deepspeed" and m["tied"] is False and set(m["matrices"]) == {"embedding", "head"}
        assert m["notes"] == [AB_NOTE]
        assert_head(m["matrices"]["head"], w)
        e = weights[NAMES["embedding"]].double().numpy()
        assert m["matrices"]["embedding"]["raw"]["mean_cosine"] == pytest.approx(ref_mean_cosine(e), rel=1e-6, abs=1e-9)
    head = load_model(ckpt, trust_checkpoint=True).matrices["head"]
    torch.testing.assert_close(head.read(0, head.shape[0]).double(), torch.from_numpy(w), rtol=1e-6, atol=1e-7)


def test_parameter_names_of_an_fsdp_checkpoint_are_the_models(trained):
    """accelerate saves ``{"model": state_dict}``: the names given and listed are the model's own."""
    ckpt = trained("fsdp2_sharded") / "run" / "checkpoint-4"
    loaded = load_model(ckpt, embedding=NAMES["head"], head=NAMES["embedding"])
    weights = load_file(ckpt.parent.parent / "weights.safetensors")
    assert torch.equal(loaded.matrices["embedding"].read(0, 64), weights[NAMES["head"]])
    with pytest.raises(ReportError, match=r"no 2-D floating-point tensor 'model\.model\.embed_tokens\.weight'.*"
                       r"\(2-D tensors: model\.embed_tokens\.weight"):
        load_model(ckpt, embedding="model.model.embed_tokens.weight")


def test_an_incomplete_deepspeed_checkpoint_names_what_is_missing(trained, tmp_path, monkeypatch):
    source = trained("zero3") / "run" / "checkpoint-4"

    def broken(name: str, *remove: str, latest: str | None = None) -> Path:
        folder = shutil.copytree(source, tmp_path / name)
        for f in remove:
            (folder / f).unlink()
        if latest is not None:
            (folder / "latest").write_text(latest)
        return folder

    rank1 = broken("rank1", "global_step4/zero_pp_rank_1_mp_rank_00_optim_states.pt")
    p, _ = _report(rank1, "--out", tmp_path / "r", "--trust-checkpoint")
    assert p.returncode == 2, p.stderr
    assert (f"the DeepSpeed checkpoint {rank1 / 'global_step4'} is incomplete: "
            "no zero_pp_rank_1_mp_rank_00_optim_states.pt") in p.stderr
    with pytest.raises(ReportError, match="incomplete: no zero_pp_rank_0_mp_rank_00_optim_states.pt"):
        load_model(broken("rank0", "global_step4/zero_pp_rank_0_mp_rank_00_optim_states.pt"), trust_checkpoint=True)
    models = [f"global_step4/zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in (0, 1)]
    with pytest.raises(ReportError, match=r"incomplete: no \*_model_states\.pt"):
        load_model(broken("models", *models), trust_checkpoint=True)
    with pytest.raises(ReportError, match="its 'latest' file names 'global_step9', but there is no .*global_step9"):
        load_model(broken("tag", latest="global_step9\n"))
    no_latest = broken("no_latest", "latest")
    with pytest.raises(ReportError, match=r"without its 'latest' file .*\(global_step4\); pass that global_stepN folder"):
        load_model(no_latest)
    assert load_model(no_latest / "global_step4", trust_checkpoint=True).kind == "deepspeed"
    with pytest.raises(ReportError, match="--text-file needs a Hugging Face model folder; .* is a DeepSpeed ZeRO checkpoint"):
        load_model(source, need_model=True)
    monkeypatch.setitem(sys.modules, "deepspeed.utils.zero_to_fp32", None)  # as if not installed
    with pytest.raises(ReportError, match=r"global_step4 is a DeepSpeed ZeRO checkpoint; .*\(pip install deepspeed\)"):
        load_model(source, trust_checkpoint=True)
