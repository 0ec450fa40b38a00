"""Axolotl's plugin (`aniso_plugins.integrations.axolotl.AnisoPlugin`) in the real ``axolotl``
(0.19.0 in CI's floor environment): a YAML with ``plugins: [...AnisoPlugin]`` and ``aniso_`` keys
builds Axolotl's own Trainer and trains AGG on a tiny Llama, padded and with Axolotl's sample
packing (``position_ids`` restarting per document); the step-1 LM-head gradient equals the
float64 three-logit reference computed from the plain run's gradient. Without ``aniso_`` keys the
plugin does nothing (no callback, no logged aniso value). Axolotl's config validation reports our
errors: a bad value, a misspelt key, Liger's fused linear cross-entropy and Cut Cross-Entropy
beside a method. The runs are subprocesses of tests/axolotl_script.py, as ``axolotl train``
builds them.

axolotl is not in the main test environment (it pins transformers 5.16.1, accelerate 1.13.0
and trl 1.9.0): `.ci/run` runs this file in the floor environment, where a missing axolotl fails
(ANISO_REQUIRE_AXOLOTL=1) instead of skipping."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest
import torch

os.environ.setdefault("AXOLOTL_DO_NOT_TRACK", "1")  # before axolotl's import: its telemetry would post, and
os.environ.setdefault("DO_NOT_TRACK", "1")  # wait for the network at exit
if os.environ.get("ANISO_REQUIRE_AXOLOTL") != "1":
    pytest.importorskip("axolotl", reason="axolotl is installed in .ci/run's floor environment only")

import yaml  # noqa: E402 - axolotl's dependency
from axolotl.integrations.base import PluginManager  # noqa: E402

from references import agg_first_step_grad  # noqa: E402

pytestmark = pytest.mark.slow

HERE = Path(__file__).resolve().parent
PLUGIN = "aniso_plugins.integrations.axolotl.AnisoPlugin"
ENV = dict(os.environ, AXOLOTL_DO_NOT_TRACK="1", DO_NOT_TRACK="1", HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1",
           PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    """A tiny untied Llama with a word-level tokenizer, and 64 lines of text as JSON lines."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from word_data import texts, tokenizer

    root = tmp_path_factory.mktemp("axolotl")
    tok = tokenizer()
    tok.save_pretrained(root / "model")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=False, bos_token_id=1, eos_token_id=1, pad_token_id=0)
    LlamaForCausalLM(config).save_pretrained(root / "model")
    (root / "data.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts(64)))
    return root


def _config(root: Path, name: str, **keys) -> dict:
    return {
        "base_model": str(root / "model"),
        "datasets": [{"path": str(root / "data.jsonl"), "ds_type": "json", "type": "completion"}],
        "dataset_prepared_path": str(root / f"prepared_{name}"), "output_dir": str(root / f"out_{name}"),
        "sequence_len": 32, "micro_batch_size": 2, "gradient_accumulation_steps": 1, "max_steps": 1,
        "learning_rate": 1e-3, "optimizer": "adamw_torch", "lr_scheduler": "constant", "max_grad_norm": 0,
        "logging_steps": 1, "save_strategy": "no", "val_set_size": 0, "bf16": False, "fp16": False, "tf32": False,
        "seed": 0, "plugins": [PLUGIN], **keys,
    }


def _train(root: Path, name: str, **keys) -> dict:
    path = root / f"{name}.yml"
    path.write_text(yaml.safe_dump(_config(root, name, **keys)))
    out = root / f"{name}.pt"
    done = subprocess.run([sys.executable, str(HERE / "axolotl_script.py"), str(path), str(out)], env=ENV,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-6000:]
    return torch.load(out, weights_only=False)


@pytest.mark.parametrize("packing", [False, True], ids=["padded", "sample_packing"])
def test_agg_trains_in_axolotl_to_the_three_logit_reference(tiny, packing):
    keys = {"sample_packing": True, "pad_to_sequence_len": True} if packing else {}
    plain = _train(tiny, f"plain_{packing}", **keys)
    agg = _train(tiny, f"agg_{packing}", aniso_method="agg", aniso_alpha=1.5, aniso_window=4,
                 aniso_metrics=["geometry"], **keys)
    assert plain["trainer"] == agg["trainer"] == "AxolotlTrainer"  # Axolotl's own Trainer, not ours
    assert "AnisoCallback" in agg["callbacks"] and "AnisoCallback" not in plain["callbacks"]
    assert not any(k.startswith("aniso") for k in plain["log_history"][0])  # no keys: nothing at all
    assert agg["log_history"][0]["aniso/geometry/head/isotropy"] > 0 and "aniso/agg/rare_size" in agg["log_history"][0]
    (labels,), (hidden,) = agg["labels"], agg["hidden"]
    assert torch.equal(labels, plain["labels"][0]) and torch.equal(agg["head0"], plain["head0"])
    if packing:  # Axolotl packed several documents per row: position_ids restart at 0 inside a row
        (pos,) = agg["position_ids"]
        assert ((pos[:, 1:] == 0).sum(1) >= 1).all(), pos
    vocab = agg["head0"].shape[0]
    expected = agg_first_step_grad(plain["grads"][0], hidden, agg["head0"], labels, 1.5, vocab)
    assert not torch.allclose(expected, plain["grads"][0].double(), rtol=1e-3, atol=1e-6)
    torch.testing.assert_close(agg["grads"][0].double(), expected, rtol=1e-5, atol=1e-7)


@pytest.fixture
def load_cfg(tiny):
    """Axolotl's ``load_cfg`` of a config dict, with its plugin registry emptied before and after."""
    from axolotl.cli.config import load_cfg as axolotl_load_cfg
    from axolotl.utils.dict import DictDefault

    PluginManager._instance = None
    yield lambda **keys: axolotl_load_cfg(DictDefault(_config(tiny, "validate", **keys)))
    PluginManager._instance = None


def test_axolotl_validation_reports_our_errors(load_cfg):
    cfg = load_cfg(aniso_method="agg", aniso_alpha=0.5)
    assert cfg.aniso_method == "agg" and cfg.aniso_alpha == 0.5 and cfg.aniso_window is None
    with pytest.raises(Exception, match=r"aniso_plugins: .*alpha"):
        load_cfg(aniso_method="agg", aniso_alpha=-1)
    with pytest.raises(Exception, match=r"aniso_plugins: unknown configuration fields "
                       r"\['alpah'\]: 'alpah' \(did you mean 'alpha'\?\)"):
        load_cfg(aniso_method="agg", aniso_alpah=0.5)
    with pytest.raises(Exception, match=r"aniso_plugins: .*method.*'agg'"):
        load_cfg(aniso_method="aggg")


def test_a_forward_that_bypasses_the_head_is_refused_naming_the_key(load_cfg):
    liger = dict(plugins=[PLUGIN, "axolotl.integrations.liger.LigerPlugin"], liger_fused_linear_cross_entropy=True)
    with pytest.raises(Exception, match=r"liger_fused_linear_cross_entropy: true .*aniso_method \['agg'\] would act on "
                       r"nothing: set liger_fused_linear_cross_entropy: false"):
        load_cfg(aniso_method="agg", **liger)
    with pytest.raises(Exception, match=r"cut_cross_entropy \(the CutCrossEntropyPlugin's, true by default\)"):
        load_cfg(aniso_method="cosreg", plugins=[PLUGIN, "cut_cross_entropy.CutCrossEntropyPlugin"], bf16=True)
    # an optimizer-side method never needs the head's forward; no aniso_ key: the plugin is inert
    assert load_cfg(aniso_method="coupled_adam", **liger).liger_fused_linear_cross_entropy
    assert load_cfg(**liger).liger_fused_linear_cross_entropy


def test_the_entry_point_names_the_plugin_and_it_is_inert_without_keys():
    from aniso_plugins.integrations.axolotl import AnisoPlugin

    (ep,) = [e for e in entry_points(group="axolotl.plugins") if e.value.startswith("aniso_plugins")]
    assert ep.load() is AnisoPlugin
    assert AnisoPlugin().add_callbacks_pre_trainer({"plugins": [], "learning_rate": 1e-3}, None) == []
