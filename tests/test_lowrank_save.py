"""A model trained with the low-rank head (W = A·B) saves what ``from_pretrained`` of its original
class loads (issue #53): ``lm_head.weight`` = A·B beside ``lm_head.A`` / ``lm_head.B``, in the
head's own state dict (`LowRankHead._save_to_state_dict`) and in a state dict handed to
``save_pretrained`` (DeepSpeed ZeRO-3's consolidated weights), while a resume restores A and B
exactly. Before, the saves held ``lm_head.A`` / ``lm_head.B`` only and ``from_pretrained``
initialised a random head: the reloaded models' logits were off by more than their largest
value (`test_trainer_saves_load_with_from_pretrained`: relative max error 1.06 for the tiny
GPT-2, 1.32 for the tiny Llama, in ``save_model``'s folder and in checkpoint-8), with only
transformers' load report saying so.

Every product is checked against A·B taken in float64 from the factors, every reloaded model's
logits against the trained model's own forward, (x·Bᵀ)·Aᵀ, and every resume against the
uninterrupted run."""

from __future__ import annotations

import copy
import os
import pickle

import lightning.pytorch as pl
import pytest
import torch
from hf_utils import TokenDataset, tiny_gpt2, tiny_llama
from lightning_utils import LitLM, loader
from safetensors.torch import load_file
from torch import nn
from transformers import AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments

from aniso_plugins import AnisoConfig, AnisoPlugins
from aniso_plugins.integrations.hf import AnisoCallback
from aniso_plugins.methods.heads.lowrank import LowRankHead
from aniso_plugins.models.handle import OutputEmbeddingsHandle

RTOL = 1e-5
"""Logits of W = A·B stored in float32 against (x·Bᵀ)·Aᵀ: float32 rounding (measured ~2e-7);
a head that is not the trained one is off by ~1."""


def _product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The reference: A·B in float64."""
    return a.detach().double() @ b.detach().double()


def _relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got.double() - expected.double()).abs().max() / expected.double().abs().max())


class TinyLM(nn.Module):
    def __init__(self, vocab=40, dim=8, rank=3, bias=True, dtype=torch.float32):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim, dtype=dtype)
        self.lm_head = LowRankHead(dim, vocab, rank, bias=bias, dtype=dtype)

    def forward(self, ids):
        return self.lm_head(self.embed(ids))


# --- the head's own state dict -----------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_state_dict_holds_the_product_and_a_strict_load_restores_the_factors(dtype):
    torch.manual_seed(0)
    model = TinyLM(dtype=dtype)
    state = model.state_dict()
    assert set(state) == {"embed.weight", "lm_head.A", "lm_head.B", "lm_head.bias", "lm_head.weight"}
    weight = state["lm_head.weight"]
    assert weight.dtype == dtype and not weight.requires_grad
    # the float64 product to the parameters' dtype's rounding (bf16: taken in float32, rounded once)
    eps, scale = torch.finfo(dtype).eps, float(_product(model.lm_head.A.abs(), model.lm_head.B.abs()).max())
    torch.testing.assert_close(weight.double(), _product(model.lm_head.A, model.lm_head.B), rtol=eps, atol=4 * eps * scale)

    fresh = TinyLM(dtype=dtype)
    assert not torch.equal(fresh.lm_head.A, model.lm_head.A)
    result = fresh.load_state_dict(state, strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    for name in ("A", "B", "bias"):
        assert torch.equal(getattr(fresh.lm_head, name), getattr(model.lm_head, name)), name
    assert "lm_head.weight" in state  # the caller's dict is left as it was

    plain = nn.Linear(8, 40, dtype=dtype)  # the original head: loads the saved product
    plain.load_state_dict({k.removeprefix("lm_head."): v for k, v in state.items() if k.startswith("lm_head.")}, strict=False)
    torch.testing.assert_close(plain.weight.detach(), weight, rtol=0, atol=0)


def test_a_state_dict_of_shards_or_placeholders_gets_no_product():
    """Only full factors of the head's shapes are multiplied: ZeRO-3's (0,) placeholders, FSDP1's
    flat shards and meta tensors are left to the route that sees the full dict."""
    head = LowRankHead(8, 40, 3)
    cases = {
        "placeholder": {"A": torch.empty(0), "B": torch.empty(0)},
        "flat shard": {"A": torch.zeros(60), "B": torch.zeros(12)},
        "meta": {"A": torch.empty(40, 3, device="meta"), "B": torch.empty(3, 8, device="meta")},
        "one factor": {"A": torch.zeros(40, 3)},
    }
    for case, state in cases.items():
        assert head.add_merged_weight(state) is False and "weight" not in state, case
    present = {"A": torch.ones(40, 3), "B": torch.ones(3, 8), "weight": torch.zeros(40, 8)}
    assert head.add_merged_weight(present) is False and torch.equal(present["weight"], torch.zeros(40, 8))
    full = {"A": torch.ones(40, 3), "B": torch.ones(3, 8)}
    assert head.add_merged_weight(full) is True and torch.equal(full["weight"], torch.full((40, 8), 3.0))


# --- save_pretrained of a handed state dict --------------------------------------------------------


def _low_rank(build):
    model = build()
    AnisoPlugins(AnisoConfig(head="lowrank", lowrank_rank=4, metrics=(), load_entry_points=False)).setup(
        handle := OutputEmbeddingsHandle(model)
    )
    with torch.no_grad():
        model.lm_head.A.add_(0.1)  # no longer the SVD of the tied embedding
    return model, handle


def test_save_pretrained_completes_a_handed_state_dict(tmp_path):
    """The HF Trainer hands ``save_pretrained`` ZeRO-3's consolidated weights, built without
    ``Module.state_dict()``: the head's product is added to that dict (a copy of it)."""
    model, _ = _low_rank(tiny_gpt2)
    given = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}  # what ZeRO-3 hands over
    model.save_pretrained(tmp_path / "keyword", state_dict=given)
    model.save_pretrained(tmp_path / "positional", True, given)
    assert "lm_head.weight" not in given
    expected = _product(model.lm_head.A, model.lm_head.B)
    for folder in ("keyword", "positional"):
        saved = load_file(tmp_path / folder / "model.safetensors")
        assert {"lm_head.A", "lm_head.B", "lm_head.weight"} <= set(saved)
        torch.testing.assert_close(saved["lm_head.weight"].double(), expected, rtol=0, atol=1e-6)


def test_the_completed_save_follows_a_deep_copy_pickles_and_leaves_with_the_head(tmp_path):
    """``save_pretrained`` on the instance is an object, not a closure: a deep copy saves its own
    weights and the model still pickles; undoing the set-up gives the class's method back, and
    keeping the head (``keep_surgery``) keeps it."""
    model, handle = _low_rank(tiny_gpt2)
    twin = copy.deepcopy(model)
    with torch.no_grad():
        twin.lm_head.A.mul_(2.0)
    given = {k: v for k, v in twin.state_dict().items() if k != "lm_head.weight"}
    twin.save_pretrained(tmp_path / "twin", state_dict=given)
    saved = load_file(tmp_path / "twin" / "model.safetensors")
    torch.testing.assert_close(saved["lm_head.weight"].double(), _product(twin.lm_head.A, twin.lm_head.B), rtol=0, atol=1e-6)
    assert twin.save_pretrained.model is twin
    unpickled = pickle.loads(pickle.dumps(model))
    assert unpickled.save_pretrained.model is unpickled and isinstance(unpickled.lm_head, LowRankHead)

    handle.restore(keep_surgery=True)
    assert "save_pretrained" in model.__dict__ and isinstance(model.lm_head, LowRankHead)
    handle.restore()
    assert "save_pretrained" not in model.__dict__ and type(model.lm_head) is nn.Linear


# --- through the HF Trainer ------------------------------------------------------------------------

STEPS, SAVE_EVERY = 8, 4
CONFIG = dict(head="lowrank", lowrank_rank=4, method="agg", metrics=(), load_entry_points=False)


class Factors(TrainerCallback):
    """The head's A and B when training begins (after a resume has loaded the checkpoint)."""

    def __init__(self, model):
        self.model, self.at_begin = model, None

    def on_train_begin(self, args, state, control, **kwargs):
        self.at_begin = {n: getattr(self.model.lm_head, n).detach().clone() for n in ("A", "B")}


def _train(build, out, resume=None):
    model = build()
    args = TrainingArguments(
        output_dir=str(out), max_steps=STEPS, per_device_train_batch_size=4, learning_rate=1e-2, report_to="none",
        use_cpu=True, disable_tqdm=True, save_strategy="steps", save_steps=SAVE_EVERY, logging_steps=100, seed=0,
    )  # fmt: skip
    factors = Factors(model)
    callbacks = [AnisoCallback(AnisoConfig(**CONFIG)), factors]
    trainer = Trainer(model=model, args=args, train_dataset=TokenDataset(n=64), callbacks=callbacks)
    trainer.train(resume_from_checkpoint=resume)
    assert isinstance(model.lm_head, LowRankHead)
    return trainer, model, factors


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def trained(request, tmp_path_factory):
    """A tied tiny model trained 8 steps with AGG on the low-rank head, checkpointing every 4, then
    ``trainer.save_model``; its logits on held-out ids (eval mode: the trained head, ungated)."""
    out = tmp_path_factory.mktemp(request.param)
    trainer, model, _ = _train({"gpt2": tiny_gpt2, "llama": tiny_llama}[request.param], out)
    trainer.save_model(str(out / "saved"))
    ids = TokenDataset(n=4, seed=3).ids
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    return request.param, out, model, ids, logits


@pytest.mark.parametrize("folder", ["saved", f"checkpoint-{STEPS}"])
def test_trainer_saves_load_with_from_pretrained(trained, folder):
    """``trainer.save_model(dir)`` and the Trainer's own checkpoint folder load with
    ``AutoModelForCausalLM.from_pretrained`` into the trained head: the same logits, untied; A and
    B are reported unused and nothing is missing."""
    _, out, model, ids, logits = trained
    loaded, info = AutoModelForCausalLM.from_pretrained(str(out / folder), output_loading_info=True)
    assert type(loaded.lm_head) is nn.Linear and loaded.config.tie_word_embeddings is False
    assert loaded.lm_head.weight is not loaded.get_input_embeddings().weight
    with torch.no_grad():
        got = loaded.eval()(input_ids=ids).logits
    assert _relative_error(got, logits) < RTOL  # before: 1.06 (GPT-2), 1.32 (Llama): a random head
    torch.testing.assert_close(loaded.lm_head.weight.detach().double(), _product(model.lm_head.A, model.lm_head.B),
                               rtol=0, atol=1e-6)  # fmt: skip
    assert not info["missing_keys"] and not info["mismatched_keys"]
    assert set(info["unexpected_keys"]) == {"lm_head.A", "lm_head.B"}  # transformers' load report lists them


def test_trainer_resume_restores_the_factors_exactly(trained, tmp_path):
    """Resumed from checkpoint-4 (which holds A, B and their product), the run starts from that
    checkpoint's A and B exactly and ends where the uninterrupted run ended."""
    name, out, model, _, _ = trained
    checkpoint = out / f"checkpoint-{SAVE_EVERY}"
    _, resumed, factors = _train({"gpt2": tiny_gpt2, "llama": tiny_llama}[name], tmp_path, resume=str(checkpoint))
    saved = load_file(checkpoint / "model.safetensors")
    for n in ("A", "B"):
        assert torch.equal(factors.at_begin[n], saved[f"lm_head.{n}"]), n
        assert torch.equal(getattr(resumed.lm_head, n), getattr(model.lm_head, n)), n


# --- Lightning -----------------------------------------------------------------------------------

PATHS = dict(head="model.lm_head", input_embedding="model.embed", blocks="model.blocks", targets="causal")


class FactorsAtStart(pl.Callback):
    """The head's A and B when training starts (after Lightning restored a checkpoint)."""

    def __init__(self):
        self.at_start = None

    def on_train_start(self, trainer, pl_module):
        self.at_start = {n: getattr(pl_module.model.lm_head, n).detach().clone() for n in ("A", "B")}


def _fit(root, max_steps, ckpt_path=None, callbacks=(), checkpointing=False):
    from aniso_plugins.integrations.lightning import AnisoCallback as LightningCallback

    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=max_steps, logger=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=str(root), num_sanity_val_steps=0, enable_checkpointing=checkpointing,
        callbacks=[LightningCallback(AnisoConfig(**CONFIG), **PATHS), *callbacks],
    )  # fmt: skip
    module = LitLM()
    trainer.fit(module, loader(), ckpt_path=ckpt_path)  # a checkpoint's state dict is loaded strictly
    return module


def test_lightning_checkpoint_holds_the_product_and_resumes_the_factors(tmp_path):
    """Lightning's ``.ckpt`` (the LightningModule's state dict) holds ``model.lm_head.weight`` = A·B;
    a resume from it loads strictly, starts from its A and B exactly and ends where the
    uninterrupted run ended (12 steps against 8 + 4, an epoch boundary)."""
    straight = _fit(tmp_path / "a", 12)
    ckpt = pl.callbacks.ModelCheckpoint(dirpath=str(tmp_path / "ck"), every_n_train_steps=8, save_top_k=-1)
    _fit(tmp_path / "b", 8, callbacks=[ckpt], checkpointing=True)
    (name,) = os.listdir(tmp_path / "ck")
    path = tmp_path / "ck" / name
    state = torch.load(path, weights_only=True)["state_dict"]
    a, b = state["model.lm_head.A"], state["model.lm_head.B"]
    torch.testing.assert_close(state["model.lm_head.weight"].double(), _product(a, b), rtol=0, atol=1e-6)

    factors = FactorsAtStart()
    resumed = _fit(tmp_path / "c", 12, ckpt_path=str(path), callbacks=[factors])
    assert torch.equal(factors.at_start["A"], a) and torch.equal(factors.at_start["B"], b)
    for (n, p), (_, q) in zip(straight.named_parameters(), resumed.named_parameters()):
        assert torch.equal(p, q), n


# --- the HF Trainer's engines on 2 processes -------------------------------------------------------


def _reference_logits(weights: dict[str, torch.Tensor], ids: torch.Tensor) -> torch.Tensor:
    """The trained model rebuilt from the engine's gathered parameters: the tiny Llama with a
    low-rank head (strict load: every parameter, A and B included), its forward (x·Bᵀ)·Aᵀ."""
    from hf_utils import VOCAB

    model = tiny_llama()
    model.lm_head = LowRankHead(model.config.hidden_size, VOCAB, CONFIG["lowrank_rank"])
    model.load_state_dict(weights, strict=True)
    with torch.no_grad():
        return model.eval()(input_ids=ids).logits


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["zero3", "fsdp1", "fsdp1_flat", "fsdp2"])
def test_engine_saves_load_with_from_pretrained_and_resume(tmp_path, engine):
    """The tied tiny Llama, AGG on the low-rank head, on 2 gloo processes through the HF Trainer
    (tests/hf_engine_script.py): ``save_model`` and checkpoint-4 load with ``from_pretrained`` into
    the trained model (the gathered parameters' logits), and a resume from checkpoint-2 ends
    where the uninterrupted run ended. ZeRO-3 hands ``save_pretrained`` its consolidated
    weights, which never pass through the head's state dict (before: no ``lm_head.weight``, a
    random head); FSDP1 and FSDP2 gather a full state dict. ZeRO-3 saves a model file only with
    ``stage3_gather_16bit_weights_on_model_save`` (the script sets it). FSDP1 resumes with SGD:
    its AdamW state does not reload exactly on CPU, without aniso_plugins too
    (tests/test_hf_engines.py::test_fsdp1_resumes)."""
    from test_hf_engines import WEIGHT_ATOL, assert_engine, result, run

    optim = ("--optim", "sgd") if engine.startswith("fsdp1") else ()
    run(tmp_path, engine, "agg_lowrank", "--save", "2", "--save-model", *optim)
    run(tmp_path, engine, "agg_lowrank", "--resume", "2", *optim)
    record, weights = result(tmp_path, "agg_lowrank")
    assert_engine(record, engine)
    ids = TokenDataset(n=4, seed=3).ids
    expected = _reference_logits(weights, ids)
    for folder in ("saved", "run/checkpoint-4"):
        loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "agg_lowrank" / folder)).eval()
        assert loaded.config.tie_word_embeddings is False and type(loaded.lm_head) is nn.Linear
        with torch.no_grad():
            assert _relative_error(loaded(input_ids=ids).logits, expected) < RTOL, folder

    resumed, resumed_weights = result(tmp_path, "agg_lowrank", "_resumed2")
    assert resumed["engine"]["start_step"] == 2  # it did resume from checkpoint-2
    assert set(resumed_weights) == set(weights)
    for name, weight in weights.items():
        torch.testing.assert_close(resumed_weights[name], weight, rtol=0, atol=WEIGHT_ATOL, msg=name)
    for name in ("lm_head.A", "lm_head.B"):
        torch.testing.assert_close(resumed_weights[name], weights[name], rtol=0, atol=1e-6, msg=name)
