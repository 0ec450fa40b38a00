"""Model zoo for tests/test_model_zoo.py: tiny random models of many transformers architectures
(built from config classes, nothing downloaded), their data, a recorder that captures what the
real Trainer did on the first optimizer step, and float64 references written out from the
formulas. Nothing here imports aniso_plugins: the references share no code with the package.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import transformers as T
from transformers import TrainerCallback, default_data_collator

VOCAB = 64
HIDDEN = 16
BATCH = 4
LENGTH = 8
SRC_LENGTH, TGT_LENGTH = 8, 6
MASK_ID = VOCAB - 1  # the masked LM's [MASK] (any id works for a random model)
IGNORE = -100


# --- data ------------------------------------------------------------------------------------
def zipf_ids(n: int, length: int, seed: int, vocab: int = VOCAB) -> torch.Tensor:
    """Token ids with a Zipf-like law (some ids frequent, many rare or unseen in a batch)."""
    g = torch.Generator().manual_seed(seed)
    p = 1.0 / torch.arange(1, vocab + 1, dtype=torch.float64)
    return torch.multinomial(p / p.sum(), n * length, replacement=True, generator=g).view(n, length)


class CausalData(torch.utils.data.Dataset):
    """labels = input_ids (the model shifts)."""

    def __init__(self, n: int = 16, length: int = LENGTH, seed: int = 0):
        self.ids = zipf_ids(n, length, seed)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class MaskedData(CausalData):
    """Every third position (from 2) is masked: input MASK_ID, label the original id; other
    labels are -100 (what DataCollatorForLanguageModeling produces, deterministically)."""

    def __getitem__(self, i):
        ids = self.ids[i].clone()
        labels = torch.full_like(ids, IGNORE)
        labels[2::3] = ids[2::3]
        ids[2::3] = MASK_ID
        return {"input_ids": ids, "labels": labels}


class Seq2SeqData(torch.utils.data.Dataset):
    """Source ids and target labels of another length; odd rows end with 1-2 ignored labels
    (padding), so the decoder's valid positions differ between rows."""

    def __init__(self, n: int = 16, seed: int = 0):
        self.src = zipf_ids(n, SRC_LENGTH, seed)
        self.tgt = zipf_ids(n, TGT_LENGTH, seed + 1000)
        for i in range(1, n, 2):
            self.tgt[i, TGT_LENGTH - 1 - (i // 2) % 2:] = IGNORE

    def __len__(self):
        return len(self.src)

    def __getitem__(self, i):
        return {"input_ids": self.src[i], "labels": self.tgt[i]}


class ExplicitDecoderInputs(Seq2SeqData):
    """Seq2SeqData with decoder_input_ids (the labels shifted right after the start id, padding
    for ignored labels), for a model that shifts its source instead of its labels (FSMT)."""

    START, PAD = 2, 1

    def __getitem__(self, i):
        labels = self.tgt[i]
        previous = torch.cat([torch.tensor([self.START]), labels[:-1]])
        return {"input_ids": self.src[i], "labels": labels,
                "decoder_input_ids": torch.where(previous == IGNORE, self.PAD, previous)}


class VarLenData(torch.utils.data.Dataset):
    """Causal examples of different lengths (lists, for padding / flattening collators)."""

    LENGTHS = (5, 8, 6, 7)

    def __init__(self, n: int = 8, seed: int = 0):
        ids = zipf_ids(n, LENGTH, seed)
        self.rows = [ids[i, : self.LENGTHS[i % len(self.LENGTHS)]].tolist() for i in range(n)]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return {"input_ids": list(self.rows[i]), "labels": list(self.rows[i])}


def pad_collator(pad_id: int):
    """Right padding: pad_id in input_ids, attention_mask 0, labels -100 at the padding."""

    def collate(features):
        n = max(len(f["input_ids"]) for f in features)
        ids = torch.full((len(features), n), pad_id, dtype=torch.long)
        labels = torch.full((len(features), n), IGNORE, dtype=torch.long)
        mask = torch.zeros((len(features), n), dtype=torch.long)
        for r, f in enumerate(features):
            k = len(f["input_ids"])
            ids[r, :k] = torch.tensor(f["input_ids"])
            labels[r, :k] = torch.tensor(f["labels"])
            mask[r, :k] = 1
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}

    return collate


class RecordingCollator:
    """Wraps a collator and keeps a copy of every batch it produced, in order (the Trainer's
    micro-batches; accelerate fetches one ahead, so the list may hold one more)."""

    def __init__(self, inner=default_data_collator):
        self.inner = inner
        self.batches: list[dict[str, Any]] = []

    def __call__(self, features):
        batch = self.inner(features)
        self.batches.append({k: v.clone() if torch.is_tensor(v) else v for k, v in batch.items()})
        return batch


# --- architectures ---------------------------------------------------------------------------
def _seeded(seed: int):
    torch.manual_seed(seed)
    return torch.Generator().manual_seed(seed + 1)


def _randomize_(tensor: torch.Tensor, g: torch.Generator, scale: float = 0.5) -> None:
    """Fill a bias (zeros at init) with random values, so the reference's bias path matters."""
    with torch.no_grad():
        tensor.copy_(torch.randn(tensor.shape, generator=g, dtype=tensor.dtype) * scale)


def gpt2(seed=0):
    _seeded(seed)
    m = T.GPT2LMHeadModel(T.GPT2Config(
        n_layer=1, n_embd=HIDDEN, n_head=2, vocab_size=VOCAB, n_positions=64, bos_token_id=0, eos_token_id=0,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    ))
    # GPT2LMHeadModel's class name maps to no loss type, so the Trainer would count position 0 in
    # num_items_in_batch (a transformers quirk, not the plugin's); tests/hf_utils.py does the same
    m.loss_type = "ForCausalLM"
    return m


def _llama_like(cls, cfg_cls, seed, tied, **extra):
    _seeded(seed)
    cfg = cfg_cls(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=tied, bos_token_id=0,
        eos_token_id=0, pad_token_id=0, attention_dropout=0.0, **extra,
    )
    return cls(cfg)


def llama(seed=0, tied=True):
    return _llama_like(T.LlamaForCausalLM, T.LlamaConfig, seed, tied)


def qwen2(seed=0):
    return _llama_like(T.Qwen2ForCausalLM, T.Qwen2Config, seed, False)


def mistral(seed=0):
    return _llama_like(T.MistralForCausalLM, T.MistralConfig, seed, False, sliding_window=None)


GEMMA2_SOFTCAP = 0.5


def gemma2(seed=0):
    # larger init so the logits reach the soft-cap's non-linear range (|z| ~ cap)
    return _llama_like(
        T.Gemma2ForCausalLM, T.Gemma2Config, seed, True, head_dim=8, query_pre_attn_scalar=8,
        final_logit_softcapping=GEMMA2_SOFTCAP, initializer_range=0.2, sliding_window=64,
    )


def gemma(seed=0):
    return _llama_like(T.GemmaForCausalLM, T.GemmaConfig, seed, True, head_dim=8)


def gpt_neox(seed=0):
    _seeded(seed)
    return T.GPTNeoXForCausalLM(T.GPTNeoXConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
        max_position_embeddings=64, hidden_dropout=0.0, attention_dropout=0.0, tie_word_embeddings=False,
        bos_token_id=0, eos_token_id=0,
    ))


def opt(seed=0):
    _seeded(seed)
    return T.OPTForCausalLM(T.OPTConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=1, ffn_dim=32, num_attention_heads=2,
        word_embed_proj_dim=HIDDEN, max_position_embeddings=64, dropout=0.0, attention_dropout=0.0,
        layerdrop=0.0, pad_token_id=1, bos_token_id=2, eos_token_id=2,
    ))


def phi(seed=0):
    g = _seeded(seed)
    m = T.PhiForCausalLM(T.PhiConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        max_position_embeddings=64, resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0,
        partial_rotary_factor=0.5, bos_token_id=0, eos_token_id=0,
    ))
    assert m.lm_head.bias is not None  # Phi's LM head has a bias
    _randomize_(m.lm_head.bias, g)
    return m


def falcon(seed=0):
    _seeded(seed)
    return T.FalconForCausalLM(T.FalconConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=1, num_attention_heads=2, hidden_dropout=0.0,
        attention_dropout=0.0, bos_token_id=0, eos_token_id=0,
    ))


def bert(seed=0):
    g = _seeded(seed)
    m = T.BertForMaskedLM(T.BertConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
        max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    ))
    _randomize_(m.get_output_embeddings().bias, g)
    return m


def _t5_config(cls_cfg, **extra):
    return cls_cfg(
        vocab_size=VOCAB, d_model=HIDDEN, d_kv=8, d_ff=32, num_layers=1, num_decoder_layers=1, num_heads=2,
        dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1, **extra,
    )


def t5(seed=0):
    _seeded(seed)
    return T.T5ForConditionalGeneration(_t5_config(T.T5Config))  # always tied in transformers 5


def mt5(seed=0):
    _seeded(seed)
    return T.MT5ForConditionalGeneration(_t5_config(T.MT5Config))  # always tied in transformers 5


def _bart_config(cls_cfg, **extra):
    return cls_cfg(
        vocab_size=VOCAB, d_model=HIDDEN, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=64, dropout=0.0,
        attention_dropout=0.0, activation_dropout=0.0, encoder_layerdrop=0.0, decoder_layerdrop=0.0, **extra,
    )


def _with_final_logits_bias(m, g):
    _randomize_(m.final_logits_bias, g)
    return m


def bart(seed=0, tied=True):
    g = _seeded(seed)
    cfg = _bart_config(T.BartConfig, pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2,
                       tie_word_embeddings=tied)  # fmt: skip
    return _with_final_logits_bias(T.BartForConditionalGeneration(cfg), g)


def marian(seed=0):
    g = _seeded(seed)
    cfg = _bart_config(T.MarianConfig, pad_token_id=VOCAB - 2, eos_token_id=0, decoder_start_token_id=VOCAB - 2,
                       decoder_vocab_size=VOCAB)
    return _with_final_logits_bias(T.MarianMTModel(cfg), g)


def pegasus(seed=0):
    g = _seeded(seed)
    cfg = _bart_config(T.PegasusConfig, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
    return _with_final_logits_bias(T.PegasusForConditionalGeneration(cfg), g)


def fsmt(seed=0):
    """FSMT: separate source and target vocabularies, an untied decoder.output_projection that
    makes the logits, while get_output_embeddings() returns the decoder's token embedding."""
    _seeded(seed)
    cfg = T.FSMTConfig(langs=["en", "de"], src_vocab_size=VOCAB + 8, tgt_vocab_size=VOCAB, d_model=HIDDEN,
                       encoder_layers=1, decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=2,
                       encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=64, dropout=0.0,
                       attention_dropout=0.0, activation_dropout=0.0, tie_word_embeddings=False, pad_token_id=1,
                       bos_token_id=0, eos_token_id=2, decoder_start_token_id=2)  # fmt: skip
    return T.FSMTForConditionalGeneration(cfg)


def _identity(model, z):
    return z


def _softcap(model, z):
    cap = model.config.final_logit_softcapping
    return torch.tanh(z / cap) * cap


def _final_logits_bias(model, z):
    return z + model.final_logits_bias.detach().double().reshape(-1)


@dataclasses.dataclass(frozen=True)
class Arch:
    name: str
    build: Callable[[], torch.nn.Module]
    kind: str  # "causal": position t predicts labels[t+1]; "masked" / "seq2seq": logits aligned with labels
    tied: bool  # head weight is the input embedding's Parameter
    post: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor] = _identity  # the model's own transform after the head
    seq2seq_trainer: bool = False  # train with Seq2SeqTrainer instead of Trainer
    fused: bool = False  # a causal LM whose loss is ForCausalLMLoss of its head's output: the fused loss reproduces it
    decoder_inputs: bool = False  # seq2seq data with explicit decoder_input_ids (the model does not shift its labels)

    def data(self, **kw):
        if self.decoder_inputs:
            return ExplicitDecoderInputs(**kw)
        return {"causal": CausalData, "masked": MaskedData, "seq2seq": Seq2SeqData}[self.kind](**kw)


ARCHS: dict[str, Arch] = {a.name: a for a in [
    Arch("gpt2", gpt2, "causal", tied=True, fused=True),
    Arch("llama_tied", lambda: llama(tied=True), "causal", tied=True, fused=True),
    Arch("llama_untied", lambda: llama(tied=False), "causal", tied=False, fused=True),
    Arch("qwen2", qwen2, "causal", tied=False, fused=True),
    Arch("mistral", mistral, "causal", tied=False, fused=True),
    Arch("gemma2_softcap", gemma2, "causal", tied=True, post=_softcap, fused=True),
    Arch("gemma", gemma, "causal", tied=True, fused=True),
    Arch("gpt_neox", gpt_neox, "causal", tied=False, fused=True),
    Arch("opt", opt, "causal", tied=True, fused=True),
    Arch("phi_bias", phi, "causal", tied=False, fused=True),
    Arch("falcon", falcon, "causal", tied=True, fused=True),
    Arch("bert_mlm", bert, "masked", tied=True),
    Arch("t5", t5, "seq2seq", tied=True),
    Arch("bart", bart, "seq2seq", tied=True, post=_final_logits_bias, seq2seq_trainer=True),
    Arch("bart_untied", lambda: bart(tied=False), "seq2seq", tied=False, post=_final_logits_bias),  # a head of its own
    Arch("marian", marian, "seq2seq", tied=True, post=_final_logits_bias),
    Arch("mt5", mt5, "seq2seq", tied=True, seq2seq_trainer=True),  # MT5Config forces tie_word_embeddings=True in transformers 5
    Arch("pegasus", pegasus, "seq2seq", tied=True, post=_final_logits_bias, seq2seq_trainer=True),
    Arch("fsmt", fsmt, "seq2seq", tied=False, decoder_inputs=True),  # the head is not get_output_embeddings() (head_of)
]}


# --- what the Trainer did on its first optimizer step ---------------------------------------
@dataclasses.dataclass
class MicroBatch:
    batch: dict[str, Any]  # the collated batch (from the recording collator)
    kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)  # what the model's forward received
    x: torch.Tensor | None = None  # the LM head's input
    z: torch.Tensor | None = None  # the LM head's output
    gx: torch.Tensor | None = None  # gradient reaching the head's input (all consumers)
    gz: torch.Tensor | None = None  # gradient reaching the head's output
    lookups: list = dataclasses.field(default_factory=list)  # [(ids, grad at the input embedding's output)]


def head_of(model: torch.nn.Module) -> torch.nn.Module:
    """The module whose output is the logits: get_output_embeddings() (a PEFT ModulesToSaveWrapper
    is kept: its forward is the trainable copy's), except FSMT's, whose forward computes the
    logits with model.decoder.output_projection (modeling_fsmt.py)."""
    if type(model).__name__ == "FSMTForConditionalGeneration":
        return model.model.decoder.output_projection
    return model.get_output_embeddings()


def trainable_head(model: torch.nn.Module) -> torch.nn.Module:
    """The head module that owns the trainable head parameters (PEFT: the modules_to_save copy)."""
    head = head_of(model)
    copies = getattr(head, "modules_to_save", None)
    return copies["default"] if copies is not None else head


class Recorder(TrainerCallback):
    """Hooks installed after Trainer(...) (so on the final head, after any head surgery): per
    training micro-batch of the first optimizer step, the LM head's input and output, the
    gradients reaching them, the model's forward kwargs; right before the first optimizer step
    (clipping is off in these tests) the gradients of `params` (name -> Parameter)."""

    def __init__(self, trainer, collator: RecordingCollator, params: dict[str, torch.nn.Parameter],
                 lookups: bool = False):
        self.collator = collator
        self.params = params
        self.grads: dict[str, torch.Tensor] | None = None
        self.mbs: list[MicroBatch] = []
        self.active = True
        model = trainer.model
        head = head_of(model)
        self.handles = [
            model.register_forward_pre_hook(self._model_pre, with_kwargs=True),
            head.register_forward_pre_hook(self._head_pre),
            head.register_forward_hook(self._head_post),
        ]
        if lookups:
            self.handles.append(model.get_input_embeddings().register_forward_hook(self._lookup))
        self.losses: list[float] = []  # what Trainer.training_step returned, per micro-batch of the first step
        training_step = trainer.training_step

        def recording_training_step(*args, **kwargs):
            loss = training_step(*args, **kwargs)
            if self.active:
                self.losses.append(float(loss))
            return loss

        trainer.training_step = recording_training_step
        trainer.add_callback(self)

    def _training(self, module):
        return self.active and module.training and torch.is_grad_enabled()

    def _model_pre(self, module, args, kwargs):
        if self._training(module):
            mb = MicroBatch(batch=self.collator.batches[len(self.mbs)])
            mb.kwargs = {k: v.detach().clone() if torch.is_tensor(v) else v for k, v in kwargs.items()}
            self.mbs.append(mb)

    def _head_pre(self, module, args):
        if self._training(module) and self.mbs and self.mbs[-1].x is None:
            mb, x = self.mbs[-1], args[0]
            mb.x = x.detach().clone()
            if x.requires_grad:
                x.register_hook(lambda g, mb=mb: setattr(mb, "gx", g.detach().clone()))

    def _head_post(self, module, args, output):
        if self._training(module) and self.mbs and self.mbs[-1].z is None:
            mb = self.mbs[-1]
            mb.z = output.detach().clone()
            if output.requires_grad:
                output.register_hook(lambda g, mb=mb: setattr(mb, "gz", g.detach().clone()))

    def _lookup(self, module, args, output):
        if self._training(module) and self.mbs:
            mb = self.mbs[-1]
            ids = args[0].detach().clone()
            slot = [ids, None]
            mb.lookups.append(slot)
            if output.requires_grad:
                output.register_hook(lambda g, slot=slot: slot.__setitem__(1, g.detach().clone()))

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if self.grads is None:
            self.grads = {n: p.grad.detach().clone() for n, p in self.params.items() if p.grad is not None}
            self.active = False


# --- references (float64, from the formulas) ------------------------------------------------
def causal_shift(labels: torch.Tensor) -> torch.Tensor:
    """Targets of a causal LM: position t predicts labels[t + 1]; the last position none."""
    return torch.cat([labels[..., 1:], torch.full_like(labels[..., :1], IGNORE)], dim=-1)


def targets_for(kind: str, labels: torch.Tensor) -> torch.Tensor:
    """What the model's own loss compares its logits with, position by position."""
    return causal_shift(labels) if kind == "causal" else labels


def agg_gates(targets: torch.Tensor, counts: torch.Tensor, alpha: float) -> torch.Tensor:
    """AGG's gate matrix Γ (rows = positions, docs/methods.md §1.3-1.5) at step 1 (a_k = counts,
    min(t, K) = 1): rare iff a_k < alpha; g1 = a_k on rare ids (rows whose target is not rare),
    g2 = min(a_k / (mean_rare a + 1e-7), 1) on rare ids (rows whose target is rare), 1 elsewhere
    and on every row's own target entry. Ignored rows get the g1 row (their CE gradient is 0)."""
    y = targets.reshape(-1)
    a = counts.double()
    rare = a < alpha
    g1 = torch.where(rare, a, torch.ones_like(a))
    mean_rare = a[rare].mean() if rare.any() else torch.tensor(0.0, dtype=torch.float64)
    g2 = torch.where(rare, torch.clamp(a / (mean_rare + 1e-7), max=1.0), torch.ones_like(a))
    valid = y != IGNORE
    row_rare = torch.zeros_like(valid)
    row_rare[valid] = rare[y[valid]]
    gate = torch.where(row_rare[:, None], g2[None, :], g1[None, :]).clone()
    rows = torch.nonzero(valid).reshape(-1)
    gate[rows, y[rows]] = 1.0
    return gate


def head_reference(x, weight, bias, targets, post, normalizer, *, gate=None, smoothing=0.0, lowrank=None):
    """Float64 autograd of the loss Σ_{valid i} ℓ_i / normalizer, ℓ_i the cross-entropy of
    post(z_i) against targets_i, z = x·Wᵀ + b the head's output. `gate` (rows × V) gates the
    gradient reaching W only (AGG: z = Γ ⊙ (sg(x)Wᵀ) + (1 − Γ) ⊙ sg(xWᵀ), x's gradient plain).
    `smoothing` ε: transformers' LabelSmoother, (1 − ε)·Σ nll / D + ε·Σ_i Σ_k (−log p_ik) / (D·V).
    `lowrank` = (A, B): W = A·B, gradients for A and B. Returns dict z, loss, dW (or dA, dB), db, dx, dz."""
    shape = x.shape
    xs = x.reshape(-1, shape[-1]).detach().double().requires_grad_(True)
    y = targets.reshape(-1)
    if lowrank is not None:
        A = lowrank[0].detach().double().requires_grad_(True)
        B = lowrank[1].detach().double().requires_grad_(True)
        w = A @ B
    else:
        w = weight.detach().double().requires_grad_(True)
    zw = xs.detach() @ w.T  # the path into W
    if gate is not None:
        zw = gate * zw + (1 - gate) * zw.detach()
    zx = xs @ w.detach().T  # the path into x
    z = zw + (zx - zx.detach())
    b = None
    if bias is not None:
        b = bias.detach().double().requires_grad_(True)
        z = z + b
    z.retain_grad()
    logits = post(z)
    valid = y != IGNORE
    logp = torch.log_softmax(logits[valid], dim=-1)
    nll = -logp.gather(1, y[valid][:, None]).sum()
    if smoothing:
        loss = (1 - smoothing) * nll / normalizer + smoothing * (-logp).sum() / (normalizer * logp.shape[-1])
    else:
        loss = nll / normalizer
    loss.backward()
    out = {"z": z.detach().reshape(*shape[:-1], -1), "loss": loss.detach(), "dx": xs.grad.reshape(shape),
           "dz": z.grad.reshape(*shape[:-1], -1), "db": None if b is None else b.grad}
    if lowrank is not None:
        out.update(dA=A.grad, dB=B.grad)
    else:
        out["dW"] = w.grad
    return out


def cosreg_grad(weight: torch.Tensor) -> torch.Tensor:
    """∇ of R(W) = 1/N² Σ_{i≠j} cos(w_i, w_j) over the N rows of nonzero norm (others get 0),
    Gao et al. 2019 with docs/methods.md §3's valid rows; float64 autograd of the explicit sum."""
    w = weight.detach().double().clone().requires_grad_(True)
    valid = w.detach().norm(dim=1) > 0
    rows = w[valid]
    u = rows / rows.norm(dim=1, keepdim=True)
    n = u.shape[0]
    cos = u @ u.T
    off = ~torch.eye(n, dtype=torch.bool)
    (cos[off].sum() / n**2).backward()
    return w.grad


def simctg_reference(hidden: torch.Tensor, valid: torch.Tensor, margin: float, segments: torch.Tensor | None = None):
    """SimCTG's L_CL (docs/methods.md §12) as a plain O(T²) loop in float64: over each sequence
    (row b, or each segment id of `segments` within a row: packed examples), every ordered pair
    i ≠ j of valid positions adds max(0, ρ − 1 + cos(h_i, h_j)); divided by Σ n(n − 1).
    A zero vector (e.g. a pad embedding's position) has cosine 0 with every vector and gets no
    gradient (docs/methods.md §12). `hidden` must require grad (float64); returns the scalar."""
    total = hidden.new_zeros(())
    pairs = 0
    rows, length = valid.shape
    for b in range(rows):
        seg = segments[b] if segments is not None else torch.zeros(length, dtype=torch.long)
        for s in sorted(set(seg.tolist())):
            idx = [t for t in range(length) if bool(valid[b, t]) and int(seg[t]) == s]
            for i in idx:
                for j in idx:
                    if i != j:
                        hi, hj = hidden[b, i], hidden[b, j]
                        if bool(hi.detach().norm() == 0) or bool(hj.detach().norm() == 0):
                            cos = hidden.new_zeros(())  # a zero vector: cosine 0, no gradient (§12)
                        else:
                            cos = (hi @ hj) / (hi.norm() * hj.norm())
                        total = total + torch.clamp(margin - 1.0 + cos, min=0.0)
            pairs += len(idx) * (len(idx) - 1)
    return total / max(pairs, 1)


def packed_segments(position_ids: torch.Tensor) -> torch.Tensor:
    """Example index of every position of a packed row: a new example starts where position_ids is 0."""
    return torch.cumsum((position_ids == 0).long(), dim=-1) - 1


def lookup_grad(lookups, vocab: int, hidden: int) -> torch.Tensor:
    """Gradient of an embedding matrix from its lookups alone: Σ over lookups of the gradient at
    the embedding's output, scattered to the looked-up rows."""
    g = torch.zeros(vocab, hidden, dtype=torch.float64)
    for ids, grad in lookups:
        if grad is not None:
            g.index_add_(0, ids.reshape(-1), grad.reshape(-1, hidden).double())
    return g


def truncated_svd_factors(weight: torch.Tensor, rank: int):
    """A = U_r S_r^½, B = S_r^½ V_rᵀ of the float64 SVD of `weight` (docs/methods.md §10)."""
    u, s, vh = torch.linalg.svd(weight.detach().double(), full_matrices=False)
    root = s[:rank].sqrt()
    return u[:, :rank] * root, root[:, None] * vh[:rank]
