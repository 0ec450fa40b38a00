"""The Lightning example (examples/lightning_train.py) shows what it is meant to show: plain MLE
drifts the tied embeddings into a cone, as the HF example's GPT-2 does. With nn.Embedding's
default N(0, 1) initialisation its mean cosine stayed at ≈ 0.0 (rows of norm ~√d barely move off
their random directions); the example now initialises like GPT-2 (N(0, 0.02²))."""

from __future__ import annotations

import math

from lightning_train import CausalLM, main


def test_weights_start_at_gpt2_scale():
    model = CausalLM(vocab=512, dim=64, layers=1, length=16)
    norms = model.embed.weight.detach().norm(dim=1)
    assert abs(float(norms.mean()) - 0.02 * math.sqrt(64)) < 0.02  # ~0.16, not ~8
    assert model.lm_head.weight is model.embed.weight


def test_mle_drifts_into_a_cone():
    mle = main(["--method", "mle", "--steps", "100", "--vocab-size", "1024"])
    assert mle["aniso/geometry/head/mean_cosine"] > 0.3  # 0.56 here; was ≈ 0.0 with the N(0, 1) rows
