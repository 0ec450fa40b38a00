"""Tiny HF models and datasets for the Trainer tests (built from configs, nothing downloaded)."""

from __future__ import annotations

import torch
from token_data import VOCAB, TokenDataset  # noqa: F401 - re-exported for the HF tests
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, TrainerCallback


def tiny_gpt2(seed: int = 0, vocab: int = VOCAB) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    cfg = GPT2Config(
        n_layer=1, n_embd=16, n_head=2, vocab_size=vocab, n_positions=32, bos_token_id=0, eos_token_id=0,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )
    model = GPT2LMHeadModel(cfg)
    model.loss_type = "ForCausalLM"  # GPT2LMHeadModel's name maps to none: the Trainer would count unshifted labels
    return model


def tiny_llama(seed: int = 0, vocab: int = VOCAB, tied: bool = True) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=tied, bos_token_id=0, eos_token_id=0,
        pad_token_id=0,
    )
    return LlamaForCausalLM(cfg)


class GradCapture(TrainerCallback):
    """Records the parameters' gradients right before each optimizer step (after clipping)."""

    def __init__(self, names: tuple[str, ...] | None = None):
        self.names = names
        self.grads: list[dict[str, torch.Tensor]] = []
        self.model = None

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.model = model

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        params = dict(self.model.named_parameters())
        names = self.names or [n for n, p in params.items() if p.grad is not None]
        self.grads.append({n: params[n].grad.detach().clone() for n in names})


class ForwardCapture:
    """Records, for training forwards, the model's `labels` and its LM head's input."""

    def __init__(self, model: torch.nn.Module):
        self.labels: list[torch.Tensor] = []
        self.hidden: list[torch.Tensor] = []
        model.register_forward_pre_hook(self._labels, with_kwargs=True)
        model.get_output_embeddings().register_forward_pre_hook(self._hidden)

    def _labels(self, module, args, kwargs):
        if module.training:
            self.labels.append(kwargs["labels"].detach().clone())

    def _hidden(self, module, args):
        if module.training:
            self.hidden.append(args[0].detach().clone())
