"""Tiny HF models and datasets for the Trainer tests (built from configs, nothing downloaded)."""

from __future__ import annotations

import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, TrainerCallback

VOCAB = 64


def tiny_gpt2(seed: int = 0, vocab: int = VOCAB) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    cfg = GPT2Config(
        n_layer=1, n_embd=16, n_head=2, vocab_size=vocab, n_positions=32, bos_token_id=0, eos_token_id=0,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )
    return GPT2LMHeadModel(cfg)


def tiny_llama(seed: int = 0, vocab: int = VOCAB, tied: bool = True) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=tied, bos_token_id=0, eos_token_id=0,
        pad_token_id=0,
    )
    return LlamaForCausalLM(cfg)


class TokenDataset(torch.utils.data.Dataset):
    """Random token sequences with a Zipf-like distribution (so some tokens are rare);
    labels = input_ids (the model shifts)."""

    def __init__(self, n: int = 32, length: int = 8, vocab: int = VOCAB, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        p = 1.0 / torch.arange(1, vocab + 1, dtype=torch.float64)
        self.ids = torch.multinomial(p / p.sum(), n * length, replacement=True, generator=g).view(n, length)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


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


class HeadInputCapture:
    """Forward hook recording the LM head's input (final hidden states) of training forwards."""

    def __init__(self, head: torch.nn.Module):
        self.inputs: list[torch.Tensor] = []
        head.register_forward_pre_hook(self._hook)

    def _hook(self, module, args):
        if module.training:
            self.inputs.append(args[0].detach().clone())
