"""torchtitan recipe for benchmarks/torchtitan_step.py: llama3's debug model widened.

``--module torchtitan_recipes --config cpu_aniso_wide`` (this folder on PYTHONPATH) builds
torchtitan's ``_debugmodel`` layout (16 heads, SwiGLU FFN of ``compute_ffn_hidden_dim(d, 256)``,
llama RoPE, untied head) with d = ``ANISO_BENCH_DIM``, V = ``ANISO_BENCH_VOCAB`` and
``ANISO_BENCH_LAYERS`` layers (environment variables: torchtitan calls recipe functions without
arguments), the loss's vocabulary set to V, as aniso_plugins' AnisoTrainer recipe shrunk for the
CPU like the test recipes (tests/torchtitan_launcher.py ``_cpu``).
"""

from __future__ import annotations

import os


def wide_debugmodel(dim: int, vocab: int, n_layers: int, n_heads: int = 16):
    """``Llama3Model.Config`` of torchtitan's debug model at width `dim` and vocabulary `vocab`."""
    from torchtitan.models.common import (
        ComplexRoPE,
        Embedding,
        Linear,
        RMSNorm,
        compute_ffn_hidden_dim,
    )
    from torchtitan.models.llama3 import (
        _EMBEDDING_INIT,
        _NORM_INIT,
        Llama3Model,
        _build_llama3_layers,
        _output_linear_init,
    )

    return Llama3Model.Config(
        dim=dim,
        vocab_size=vocab,
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init=_EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=_NORM_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=_output_linear_init(dim)),
        layers=_build_llama3_layers(
            fuse_qkv=True,
            n_layers=n_layers,
            dim=dim,
            n_heads=n_heads,
            hidden_dim=compute_ffn_hidden_dim(dim, multiple_of=256),
            rope=ComplexRoPE.Config(dim=dim // n_heads, max_seq_len=131072, theta=500000, scaling="llama"),
            attn_backend="flex",
        ),
    )


def cpu_aniso_wide():
    """The AnisoTrainer debug recipe with the widened model, shrunk for the CPU."""
    from aniso_plugins.integrations.torchtitan import aniso_trainer_config
    from torchtitan.models.llama3.config_registry import llama3_debugmodel
    from torchtitan_launcher import _cpu

    dim, vocab = int(os.environ["ANISO_BENCH_DIM"]), int(os.environ["ANISO_BENCH_VOCAB"])
    n_layers = int(os.environ.get("ANISO_BENCH_LAYERS", "6"))
    base = llama3_debugmodel()
    base.model_spec.model = wide_debugmodel(dim, vocab, n_layers)
    base.loss.loss_fn.global_vocab_size = vocab
    return _cpu(aniso_trainer_config(base), n_layers=n_layers)
