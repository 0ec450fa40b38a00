"""Unsupervised SimCSE: the InfoNCE loss and the pooling against explicit float64 loops, the pair
collator, and the plugin through a real transformers.Trainer on a tiny BertForMaskedLM: the
first step's gradient against a float64 reference (pure SimCSE, where the term is the whole
loss; SimCSE + MLM, where it is added to the MLM loss), the logged loss and metrics, 2 DDP
ranks (slow), and the effect on the uniformity of held-out sentence embeddings.

Run as a script under torchrun, this file is the DDP worker of `test_two_rank_ddp_...`."""

from __future__ import annotations

import copy
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from transformers import (
    BertConfig,
    BertForMaskedLM,
    DataCollatorForLanguageModeling,
    DataCollatorWithPadding,
    PreTrainedTokenizerFast,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

from aniso_plugins import AnisoConfig, ConfigError, SimCSECollator, TrainingSession
from aniso_plugins.core.targets import MicroBatchTargets
from aniso_plugins.integrations.hf import AnisoCallback, hf_handle
from aniso_plugins.methods.simcse.contrastive import info_nce, pool

HERE = os.path.dirname(os.path.abspath(__file__))
V = 100
SPECIALS = {"[PAD]": 0, "[UNK]": 1, "[CLS]": 2, "[SEP]": 3, "[MASK]": 4}
QUIET = dict(report_to="none", use_cpu=True, disable_tqdm=True, save_strategy="no", seed=0, data_seed=0)


# --- tiny parts -----------------------------------------------------------------------------
def tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer over "[PAD] [UNK] [CLS] [SEP] [MASK] w5 ... w99" (built in memory)."""
    vocab = {**SPECIALS, **{f"w{i}": i for i in range(len(SPECIALS), V)}}
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="[UNK]")),
        pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]",
    )


def tiny_bert(seed: int = 0, dropout: float = 0.0, init_range: float = 0.3) -> BertForMaskedLM:
    """A 2-layer BERT; init_range 0.3 spreads the untrained [CLS] vectors (with BERT's 0.02 they
    coincide to 1e-5, where float32 cosines have too few significant digits for the reference)."""
    torch.manual_seed(seed)
    cfg = BertConfig(
        vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=32, hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout,
        initializer_range=init_range, pad_token_id=0,
    )
    return BertForMaskedLM(cfg)


class Sentences(torch.utils.data.Dataset):
    """[CLS] w.. w.. [SEP] of random words, 3 to 12 words long (batches need padding)."""

    def __init__(self, n: int = 32, seed: int = 0, lengths: tuple[int, int] = (3, 13)):
        g = torch.Generator().manual_seed(seed)
        sizes = torch.randint(*lengths, (n,), generator=g).tolist()
        self.rows = [[2] + torch.randint(len(SPECIALS), V, (k,), generator=g).tolist() + [3] for k in sizes]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, list[int]]:
        return {"input_ids": self.rows[i]}


class GradCapture(TrainerCallback):
    """The parameters' gradients right before the first optimizer step (after clipping)."""

    def __init__(self):
        self.grads: dict[str, torch.Tensor] | None = None
        self.model = None

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.model = model

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if self.grads is None:
            self.grads = {n: p.grad.detach().clone() for n, p in self.model.named_parameters() if p.grad is not None}


class BatchCapture:
    """The model's inputs of every training forward."""

    def __init__(self, model: torch.nn.Module):
        self.batches: list[dict[str, torch.Tensor]] = []
        model.register_forward_pre_hook(self._record, with_kwargs=True)

    def _record(self, module, args, kwargs):
        if module.training:
            keys = ("input_ids", "attention_mask", "labels")
            self.batches.append({k: kwargs[k].detach().clone() for k in keys if k in kwargs})


def train(tmp_path, config, collator, model=None, callbacks=(), dataset=None, **args):
    kw = dict(QUIET, output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=1, learning_rate=1e-2,
              gradient_accumulation_steps=2, max_grad_norm=0.0, logging_steps=1)
    kw.update(args)
    model = model if model is not None else tiny_bert()
    trainer = Trainer(
        model=model, args=TrainingArguments(**kw), train_dataset=dataset or Sentences(), data_collator=collator,
        callbacks=[AnisoCallback(config), *callbacks],
    )
    trainer.train()
    return trainer


def simcse_config(**kw) -> AnisoConfig:
    return AnisoConfig(method="simcse", metrics=(), load_entry_points=False, **kw)


# --- float64 references ---------------------------------------------------------------------
def ref_info_nce(z1: torch.Tensor, z2: torch.Tensor, tau: float) -> torch.Tensor:
    """mean_i −log softmax_j(cos(z1_i, z2_j)/τ)[i], one scalar op at a time (float64)."""
    n = len(z1)
    total = torch.zeros((), dtype=torch.float64)
    for i in range(n):
        logits = [(z1[i] * z2[j]).sum() / (z1[i].norm() * z2[j].norm()) / tau for j in range(n)]
        top = max(float(x.detach()) for x in logits)
        log_den = top + torch.log(sum(torch.exp(x - top) for x in logits))
        total = total + (log_den - logits[i])
    return total / n


def ref_pool(hidden: torch.Tensor, mask: torch.Tensor, pooling: str) -> torch.Tensor:
    rows = []
    for b in range(hidden.shape[0]):
        if pooling == "cls":
            rows.append(hidden[b, 0])
        else:
            kept = [hidden[b, t] for t in range(hidden.shape[1]) if mask[b, t] != 0]
            rows.append(sum(kept) / len(kept))
    return torch.stack(rows)


def ref_uniformity(z: np.ndarray, t: float = 2.0) -> float:
    """log mean_{i≠j} exp(−t‖ẑ_i − ẑ_j‖²), numpy float64."""
    u = z / np.linalg.norm(z, axis=1, keepdims=True)
    n = len(u)
    terms = [math.exp(-t * float(np.sum((u[i] - u[j]) ** 2))) for i in range(n) for j in range(n) if i != j]
    return math.log(sum(terms) / len(terms))


def ref_terms(model0: BertForMaskedLM, batches, pooling: str, tau: float):
    """Per micro-batch (in order): the InfoNCE of its pairs on a float64 copy of the initial
    model, and that copy (its parameters hold the gradients of the sum after `.backward()`)."""
    ref = copy.deepcopy(model0).double().eval()  # dropout is 0: eval and train agree
    losses, views = [], []
    for batch in batches:
        mask = batch["attention_mask"]
        hidden = ref.bert(input_ids=batch["input_ids"], attention_mask=mask, output_hidden_states=True).hidden_states[-1]
        z = ref_pool(hidden, mask, pooling)
        losses.append(ref_info_nce(z[0::2], z[1::2], tau))
        views.append((z[0::2].detach(), z[1::2].detach()))
    return ref, losses, views


def assert_grads(got: dict[str, torch.Tensor], ref: torch.nn.Module, scale: float = 1.0, base=None) -> None:
    """Every parameter's captured gradient (minus `base`'s) equals the reference's × scale;
    parameters the reference does not reach have no (or a zero) captured gradient."""
    checked = 0
    for name, p in ref.named_parameters():
        g = got.get(name)
        if base is not None and g is not None:
            g = g - base[name]
        if p.grad is None or p.grad.abs().max() == 0:
            assert g is None or g.abs().max() < 1e-6, name
            continue
        assert g is not None, f"{name}: no gradient captured"
        torch.testing.assert_close(g.double(), scale * p.grad, rtol=2e-4, atol=2e-7, msg=name)
        checked += 1
    assert checked >= 10  # the encoder's weights, not just one tensor


# --- the math -------------------------------------------------------------------------------
def test_info_nce_value_and_gradient_equal_an_explicit_loop():
    g = torch.Generator().manual_seed(1)
    z1 = torch.randn(6, 5, generator=g, dtype=torch.float64, requires_grad=True)
    z2 = (z1.detach() + 0.7 * torch.randn(6, 5, generator=g, dtype=torch.float64)).requires_grad_(True)
    for tau in (0.05, 1.0):
        got = info_nce(z1, z2, tau)
        expected = ref_info_nce(z1, z2, tau)
        assert got.dtype == torch.float64
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
        g_got = torch.autograd.grad(got, (z1, z2))
        g_ref = torch.autograd.grad(expected, (z1, z2))
        for a, b in zip(g_got, g_ref):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    # identical views: the loss is the negatives' part only, log Σ_j exp((cos_ij − 1)/τ) > 0
    same = ref_info_nce(z1.detach(), z1.detach(), 0.05)
    torch.testing.assert_close(info_nce(z1.detach(), z1.detach(), 0.05), same)
    assert float(same) > 0
    # float32 / bf16 autocast: computed in float32, the matmul not downcast
    z1f, z2f = z1.detach().float(), z2.detach().float()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = info_nce(z1f, z2f, 0.05)
    assert low.dtype == torch.float32
    assert float(low) == pytest.approx(float(ref_info_nce(z1.detach(), z2.detach(), 0.05)), rel=1e-5)
    with pytest.raises(ValueError, match="one shape"):
        info_nce(z1, z2[:5], 0.05)


def test_pool_equals_explicit_cls_and_masked_mean():
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(3, 5, 4, generator=g, dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 0, 0, 0, 0]])
    for pooling in ("cls", "mean"):
        got = pool(hidden, mask, pooling)
        expected = ref_pool(hidden, mask, pooling)
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
        w = torch.randn(3, 4, generator=g, dtype=torch.float64)
        g_got, = torch.autograd.grad((got * w).sum(), hidden)
        g_ref, = torch.autograd.grad((expected * w).sum(), hidden)
        torch.testing.assert_close(g_got, g_ref)
    torch.testing.assert_close(pool(hidden, None, "mean"), hidden.mean(1))
    low = pool(hidden.detach().bfloat16(), mask, "mean")
    assert low.dtype == torch.float32  # bf16 activations are summed in float32
    expected = ref_pool(hidden.detach().bfloat16().double(), mask, "mean")
    torch.testing.assert_close(low.double(), expected, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="does not match"):
        pool(hidden, mask[:, :4], "mean")


def test_collator_puts_each_example_in_rows_2i_and_2i_plus_1():
    features = [{"input_ids": [2, 7, 3]}, {"input_ids": [2, 9, 8, 6, 3]}, {"input_ids": [2, 5, 3]}]
    assert SimCSECollator(list)(features) == [f for f in features for _ in range(2)]

    tok = tokenizer()
    batch = SimCSECollator(DataCollatorWithPadding(tok))(features)
    assert batch["input_ids"].shape == (6, 5)
    for i, f in enumerate(features):
        for row in (2 * i, 2 * i + 1):
            n = len(f["input_ids"])
            assert batch["input_ids"][row, :n].tolist() == f["input_ids"]
            assert batch["attention_mask"][row].tolist() == [1] * n + [0] * (5 - n)

    # a masking collator sees the copies as two examples and masks them independently
    torch.manual_seed(0)
    long = [{"input_ids": [2] + list(range(5, 45)) + [3]} for _ in range(4)]
    mlm = SimCSECollator(DataCollatorForLanguageModeling(tok, mlm=True, mlm_probability=0.5))(long)
    assert torch.equal(mlm["attention_mask"][0::2], mlm["attention_mask"][1::2])
    assert not torch.equal(mlm["labels"][0::2], mlm["labels"][1::2])
    original = torch.where(mlm["labels"] != -100, mlm["labels"], mlm["input_ids"])
    assert torch.equal(original[0::2], original[1::2])  # the same sentence underneath
    with pytest.raises(TypeError, match="collator"):
        SimCSECollator("not a collator")


# --- through the HF Trainer -----------------------------------------------------------------
@pytest.mark.parametrize("pooling", ["cls", "mean"])
def test_label_free_first_step_gradient_and_logged_loss_equal_the_float64_reference(tmp_path, pooling):
    weight, tau = 0.5, 0.05
    model = tiny_bert()
    model0 = copy.deepcopy(model)
    grads, seen = GradCapture(), BatchCapture(model)
    cfg = simcse_config(simcse_weight=weight, simcse_pooling=pooling)
    trainer = train(tmp_path, cfg, SimCSECollator(DataCollatorWithPadding(tokenizer())), model=model, callbacks=[grads])
    assert len(seen.batches) == 2 and "labels" not in seen.batches[0]  # 2 micro-batches of 4 pairs, no token loss
    assert seen.batches[0]["input_ids"].shape[0] == 8
    ref, losses, _ = ref_terms(model0, seen.batches, pooling, tau)
    expected = weight * sum(losses) / len(losses)  # the step's mean over its micro-batches
    expected.backward()
    assert_grads(grads.grads, ref)
    record = trainer.state.log_history[0]
    assert record["loss"] == pytest.approx(float(expected.detach()), rel=1e-5)  # the Trainer logs the term as its loss
    assert record["aniso/loss/simcse"] == pytest.approx(float(expected.detach()), rel=1e-5)


def test_with_mlm_labels_the_term_is_added_to_the_mlm_gradient_and_metrics_are_logged(tmp_path):
    weight, tau = 0.3, 0.05
    runs = {}
    for method in ("none", "simcse"):
        model = tiny_bert()
        model0 = copy.deepcopy(model)
        grads, seen = GradCapture(), BatchCapture(model)
        collator = SimCSECollator(DataCollatorForLanguageModeling(tokenizer(), mlm=True, mlm_probability=0.3))
        cfg = AnisoConfig(method=method, simcse_weight=weight, metrics=(), load_entry_points=False)
        trainer = train(tmp_path, cfg, collator, model=model, callbacks=[grads])
        runs[method] = (grads.grads, seen.batches, trainer.state.log_history[0])
    (g_none, b_none, _), (g_cse, batches, record) = runs["none"], runs["simcse"]
    for a, b in zip(b_none, batches):  # the same masked batches in both runs
        assert all(torch.equal(a[k], b[k]) for k in ("input_ids", "attention_mask", "labels"))
    assert not torch.equal(batches[0]["input_ids"][0::2], batches[0]["input_ids"][1::2])  # masked independently
    ref, losses, views = ref_terms(model0, batches, "cls", tau)
    expected = weight * sum(losses) / len(losses)
    expected.backward()
    assert_grads(g_cse, ref, base=g_none)
    assert record["aniso/loss/simcse"] == pytest.approx(float(expected.detach()), rel=1e-5)
    # metrics: the last measured micro-batch's pairs (the masked copies are not aligned exactly)
    z1, z2 = (v.numpy() for v in views[-1])
    u1, u2 = (z / np.linalg.norm(z, axis=1, keepdims=True) for z in (z1, z2))
    align = float(np.mean(np.sum((u1 - u2) ** 2, axis=1)))
    assert align > 1e-3
    assert record["aniso/simcse/alignment"] == pytest.approx(align, rel=1e-4)
    assert record["aniso/simcse/uniformity"] == pytest.approx(ref_uniformity(z1), rel=1e-4, abs=1e-6)


def test_batches_that_are_not_pairs_are_refused_before_the_first_step(tmp_path):
    tok = tokenizer()
    model = tiny_bert()
    w = model.bert.embeddings.word_embeddings.weight.detach().clone()
    with pytest.raises(ConfigError, match="SimCSECollator"):
        train(tmp_path, simcse_config(), DataCollatorWithPadding(tok), model=model)  # forgot the collator
    assert torch.equal(model.bert.embeddings.word_embeddings.weight, w)
    with pytest.raises(ConfigError, match="SimCSECollator"):  # MLM: the padding of rows 2i, 2i+1 differs
        train(tmp_path, simcse_config(), DataCollatorForLanguageModeling(tok, mlm=True), model=tiny_bert())

    session = TrainingSession(simcse_config())
    session.setup(hf_handle(tiny_bert()))
    session.begin_training()
    ids = torch.tensor([[0, 2, 5, 3], [0, 2, 5, 3]])
    with pytest.raises(ConfigError, match="left padding"):
        session.begin_micro_batch(MicroBatchTargets(torch.full_like(ids, -100), ids, (ids != 0).long()), step=1)
    ids = ids[:1]
    with pytest.raises(ConfigError, match="not \\(2N, T\\) pairs"):
        session.begin_micro_batch(MicroBatchTargets(torch.full_like(ids, -100), ids, (ids != 0).long()), step=1)
    packed = torch.tensor([[2, 5, 3, 2, 5, 3], [2, 5, 3, 2, 5, 3]])  # two sentences per row
    with pytest.raises(ConfigError, match="packed micro-batch"):
        session.begin_micro_batch(MicroBatchTargets(torch.full_like(packed, -100), packed,
                                                    sequence_ids=torch.tensor([[0, 0, 0, 1, 1, 1]] * 2)), step=1)  # fmt: skip


def test_simcse_spreads_held_out_sentence_embeddings(tmp_path):
    """Dropout on, BERT's own initialization: 20 steps of SimCSE (mean pooling) lower L_uniform
    of held-out sentence vectors well below the untrained model's and an MLM-only run's (same
    steps, data and learning rate)."""
    sentences = Sentences(48, seed=99)
    held_out = DataCollatorWithPadding(tokenizer())([sentences[i] for i in range(len(sentences))])

    def l_uniform(model):
        model.eval()
        with torch.no_grad():
            h = model.bert(**held_out, output_hidden_states=True).hidden_states[-1].double()
        mask = held_out["attention_mask"]
        z = [(h[b] * mask[b, :, None]).sum(0) / mask[b].sum() for b in range(len(h))]
        return ref_uniformity(torch.stack(z).numpy())

    def model():
        return tiny_bert(seed=3, dropout=0.1, init_range=0.02)

    steps = dict(max_steps=20, per_device_train_batch_size=16, gradient_accumulation_steps=1, learning_rate=1e-3,
                 logging_steps=20, dataset=Sentences(320, seed=5))
    untrained = l_uniform(model())
    mlm = train(tmp_path, AnisoConfig(metrics=(), load_entry_points=False),
                DataCollatorForLanguageModeling(tokenizer(), mlm=True), model=model(), **steps)
    cse = train(tmp_path, simcse_config(simcse_pooling="mean"), SimCSECollator(DataCollatorWithPadding(tokenizer())),
                model=model(), **steps)
    u_mlm, u_cse = l_uniform(mlm.model), l_uniform(cse.model)
    print(f"L_uniform of held-out mean-pooled vectors: untrained {untrained:.3f}, MLM {u_mlm:.3f}, SimCSE {u_cse:.3f}")
    assert u_cse < untrained - 1.0 and u_cse < u_mlm - 1.0


# --- two DDP ranks --------------------------------------------------------------------------
@pytest.mark.slow
def test_two_rank_ddp_gradient_is_the_mean_of_per_rank_infonce_gradients(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           __file__, str(tmp_path)]
    done = subprocess.run(cmd, env=env, timeout=300, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-4000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    assert ranks[0]["metrics"] == ranks[1]["metrics"]
    weight, tau = 0.5, 0.05
    batches = [b for r in ranks for b in r["batches"][:2]]  # step 1: 2 ranks × 2 micro-batches
    assert len(batches) == 4 and not torch.equal(batches[0]["input_ids"], batches[2]["input_ids"])  # each rank its own
    ref, losses, views = ref_terms(tiny_bert(), batches, "cls", tau)
    expected = weight * sum(losses) / len(losses)  # mean over ranks and micro-batches of the per-rank InfoNCE
    expected.backward()
    for r in ranks:
        assert_grads(r["grads"], ref)
    record = ranks[0]["metrics"]
    assert record["loss"] == pytest.approx(float(expected.detach()), rel=1e-5)
    assert record["aniso/loss/simcse"] == pytest.approx(float(expected.detach()), rel=1e-5)
    # uniformity pooled over the ranks' last micro-batches: within-rank pairs only
    sums, pairs = 0.0, 0
    for z1, _ in (views[1], views[3]):
        u = z1.numpy() / np.linalg.norm(z1.numpy(), axis=1, keepdims=True)
        n = len(u)
        sums += sum(math.exp(-2.0 * float(np.sum((u[i] - u[j]) ** 2))) for i in range(n) for j in range(n) if i != j)
        pairs += n * (n - 1)
    assert record["aniso/simcse/uniformity"] == pytest.approx(math.log(sums / pairs), rel=1e-4)
    assert abs(record["aniso/simcse/alignment"]) < 1e-8  # dropout 0: the two views coincide


def _ddp_worker(out: str) -> None:
    rank = int(os.environ["RANK"])
    model = tiny_bert()
    grads, seen = GradCapture(), BatchCapture(model)
    trainer = train(out, simcse_config(simcse_weight=0.5), SimCSECollator(DataCollatorWithPadding(tokenizer())),
                    model=model, callbacks=[grads], ddp_backend="gloo", max_steps=2)  # DDP must not stall after step 1
    assert trainer.args.world_size == 2
    torch.save({"grads": grads.grads, "batches": seen.batches, "metrics": trainer.state.log_history[0]},
               os.path.join(out, f"rank{rank}.pt"))


if __name__ == "__main__":
    _ddp_worker(sys.argv[1])
