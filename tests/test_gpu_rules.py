"""The rules a GPU enforces, checked on the CPU (tests/device_discipline.py, docs/performance.md "What
the GPU pays"): no host read in a steady-state training step, state on the model's device from the
start of training, collectives that take device tensors only.

References: the counter's values are the float64 / dense-ring references of tests/test_counter.py
and tests/test_agg_gating.py; here the same code paths are run for what they read back (`HostSyncs`
counts the ops that read a value to the host on CUDA) and where their tensors live (`fake_cuda`: a
fake ``cuda`` device that raises on a host read, a data-dependent shape or a host tensor meeting a
device tensor).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from aniso_plugins import AnisoConfig, AnisoPlugins, RunInfo, StepInfo, TrainingSession
from aniso_plugins.core.loss_scale import DeepSpeedLossScale
from aniso_plugins.core.model import ModelHandle
from aniso_plugins.core.targets import count_targets
from aniso_plugins.methods.agg.counter import SlidingTokenCounter
from aniso_plugins.methods.agg.gates import agg_gates, rare_fraction_alpha
from device_discipline import TRAINING_METHODS, HostSyncs, StepWindow, fake_cuda, hf_window, lightning_window

V = 40


def _stream(steps: int, micro: int = 2, seed: int = 0) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    p = torch.arange(1, V + 1, dtype=torch.float64).pow(-1.1)
    out = []
    for _ in range(steps):
        parts = [torch.multinomial(p, 24, replacement=True, generator=g).view(2, 12) for _ in range(micro)]
        for part in parts:
            part[:, -1] = -100
        out.append(parts)
    return out


def _agg_step(counter: SlidingTokenCounter, targets: list[torch.Tensor], tokens: int | None) -> torch.Tensor:
    """What AGG does per optimizer step with its counter: count, appearance, α by share, gates."""
    counter.update(targets)
    a = counter.appearance() if tokens is None else counter.appearance_per_tokens(tokens)
    alpha, _ = rare_fraction_alpha(counter.counts(), a, 0.1, counter.always_frequent_ids)
    gates = agg_gates(a, alpha, steps=counter.steps_in_window)
    counter.step()
    return gates.g1


@pytest.mark.parametrize("tokens", [None, 64], ids=["per_update", "per_tokens"])
def test_the_agg_counter_and_gates_read_nothing_back_in_a_steady_step(tokens):
    """Counting (index_add_, the range by _assert_async), the appearance, rare_fraction's α (sort,
    cumsum, argmin) and the gates: 0 host reads per step, across window evictions (K = 3); the
    copies of the completed steps to the host resolve a step later, on the host (NumPy)."""
    counter = SlidingTokenCounter(V, 3, always_frequent=(0,))
    stream = _stream(10)
    for targets in stream[:2]:
        _agg_step(counter, targets, tokens)
    with HostSyncs(where=True) as syncs:
        for targets in stream[2:]:
            _agg_step(counter, targets, tokens)
    assert syncs.total == 0, dict(syncs.sites)
    # and the counts are the window's (the last K - 1 = 2 completed steps)
    recent = torch.cat([t.reshape(-1) for step in stream[-2:] for t in step])
    assert torch.equal(counter.counts(), torch.bincount(recent[recent != -100], minlength=V))


def test_rare_fraction_alpha_on_the_device_equals_the_written_out_rule():
    """The sort / cumsum / argmin version against the rule written out over the distinct counts
    (tests/test_agg_gating.py: the nearest share, the smaller on a tie, never-seen ids always rare,
    specials never), with specials anywhere in the vocabulary."""
    g = torch.Generator().manual_seed(5)
    counts = torch.bincount(torch.multinomial(torch.arange(1, 201.0).pow(-1.3), 3000, replacement=True, generator=g),
                            minlength=200)
    specials = (3, 0, 150)
    c = counts.numpy()
    other = ~np.isin(np.arange(200), specials)
    for fraction in (0.01, 0.1, 0.3, 0.7, 0.99):
        appearance = counts.float() / 5
        appearance[list(specials)] = 1.0
        alpha, share = rare_fraction_alpha(counts, appearance, fraction, specials)
        shares = [c[other & (c < v)].sum() / c.sum() for v in np.unique(c[other]) if v > 0] + [c[other].sum() / c.sum()]
        expected = min(sorted(shares), key=lambda s: abs(s - fraction))
        rare = (appearance < alpha).numpy() & other
        assert float(share) == pytest.approx(expected, abs=1e-12) and rare[c == 0].all()
        assert c[rare].sum() / c.sum() == pytest.approx(expected, abs=1e-12)


def test_the_agg_counter_and_gates_run_on_a_fake_cuda_device():
    """Every tensor of the counter, the appearance, α and the gates stays on the device; nothing
    reads back (the fake device raises on a read, a data-dependent shape, a host tensor)."""
    with fake_cuda():
        counter = SlidingTokenCounter(V, 3, always_frequent=(0, 1), device="cuda")
        for _ in range(5):
            targets = [torch.randint(0, V, (2, 12), device="cuda") for _ in range(2)]
            g1 = _agg_step(counter, targets, 64)
            assert g1.device.type == "cuda" and counter.counts().device.type == "cuda"


def test_coupled_adam_and_centering_run_on_a_fake_cuda_device():
    """Coupled Adam's step (its step count and bias corrections on the device) through a fused
    AdamW's hooks, with the fp16 scaler's found_inf, and μ-centering: no host read, no host tensor."""
    from aniso_plugins.methods.centering.centering import center_rows_
    from aniso_plugins.methods.coupled_adam.update import CoupledAdam

    with fake_cuda():
        e = nn.Parameter(torch.randn(V, 8, device="cuda"))
        b = nn.Parameter(torch.randn(8, device="cuda"))
        opt = torch.optim.AdamW([e, b], lr=1e-2, fused=True)
        CoupledAdam(opt, [e])
        for _ in range(3):
            e.grad, b.grad = torch.randn_like(e), torch.randn_like(b)
            opt.found_inf = torch.zeros((), device="cuda")
            opt.step()
            center_rows_(e)
        assert opt.state[e]["step"].device.type == "cuda" and e.device.type == "cuda"


def test_count_targets_reads_nothing_back_and_names_a_bad_id_on_the_cpu():
    y = torch.tensor([[1, 2, 2, -100], [5, 5, 5, 0]])
    with HostSyncs() as syncs:
        counts = count_targets(y, 7)
    assert syncs.total == 0 and counts.tolist() == [1, 1, 2, 0, 0, 3, 0]
    with pytest.raises(ValueError, match=r"\[0, 7\).*got values in \[-3, 9\]"):
        count_targets(torch.tensor([1, -3, 9, -100]), 7)
    with fake_cuda():
        assert count_targets(torch.zeros(3, 4, dtype=torch.long, device="cuda"), 7).device.type == "cuda"


class TinyLM(nn.Module):
    def __init__(self, device: str = "cpu"):
        super().__init__()
        self.embed = nn.Embedding(V, 8, device=device)
        self.lm_head = nn.Linear(8, V, bias=False, device=device)

    def forward(self, ids):
        return self.lm_head(torch.tanh(self.embed(ids)))


def test_collectives_take_tensors_on_the_model_device(monkeypatch):
    """AGG's counts and the frequency metric's, on a model on a (fake) GPU under data parallelism:
    every tensor handed to all_reduce is on the device, also on a rank whose first step has no
    targets yet (the frequency counts were made on the host and moved only with the first batch:
    an NCCL all-reduce of a host tensor fails or hangs)."""
    import aniso_plugins.metrics.frequency.groups as groups
    import aniso_plugins.methods.agg.plugin as agg_plugin

    seen: list[str] = []
    monkeypatch.setattr(dist, "all_reduce", lambda tensor, *a, **k: seen.append(tensor.device.type))
    for module in (groups, agg_plugin):
        monkeypatch.setattr(module, "is_distributed", lambda: True)
    # (window 8: the gating check reads two numbers once a run, at the step that fills the window)
    config = AnisoConfig(method="agg", alpha=0.5, window=8, metrics=("frequency",), load_entry_points=False)
    with fake_cuda():
        plugins = AnisoPlugins(config)
        plugins.setup(ModelHandle(TinyLM("cuda"), head="lm_head", input_embedding="embed"))
        plugins.begin_training(RunInfo())
        plugins.step_end(StepInfo(step=1))  # a rank with no batch in its first step
        for t in range(2, 5):
            targets = torch.randint(0, V, (2, 12), device="cuda")
            plugins.step_targets([targets], StepInfo(step=t))
            plugins.targets(targets, StepInfo(step=t))
            plugins.get("agg").head.disarm()  # (its forward is the fused loss's, tested on its own)
            plugins.step_end(StepInfo(step=t))
    assert seen and set(seen) == {"cuda"}, seen


def test_loss_terms_and_the_fp16_loss_scale_are_read_only_at_measurement():
    """CosReg through the session under an fp16 grad scaler: the term's value is kept as a device
    tensor and the scale read as one (no .item() per micro-batch); both are read when measured."""
    model = TinyLM()
    session = TrainingSession(AnisoConfig(method="cosreg", metrics=(), load_entry_points=False))
    session.setup(ModelHandle(model, head="lm_head", input_embedding="embed"))
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    session.begin_training(grad_scaler=scaler)
    ids = torch.randint(0, V, (2, 6))
    grads = []
    for step in (1, 2, 3):
        with HostSyncs(where=True) as syncs:
            session.begin_micro_batch(ids, step=step)
            loss = F.cross_entropy(model(ids).reshape(-1, V), ids.reshape(-1))
            scaler.scale(loss).backward()
            session.end_step(step)
        if step > 1:  # the scaler's scale tensor exists from its first scale()
            assert syncs.total == 0, dict(syncs.sites)
        grads.append(model.embed.weight.grad.clone())
        model.zero_grad()
    metrics = session.measure(3)
    w = model.lm_head.weight.detach().double()  # CosReg acts on the LM head
    u = w / w.norm(dim=1, keepdim=True)
    expected = ((u.sum(0).norm() ** 2 - V) / V**2).item()  # CosReg, docs/methods.md §3
    assert metrics["aniso/loss/cosreg"] == pytest.approx(expected, rel=1e-5)


def test_deepspeeds_loss_scale_is_probed_on_the_engines_device():
    class Optimizer:
        def scale_if_loss(self, loss):
            return loss * 128.0

    engine = type("Engine", (), {"optimizer": Optimizer(), "device": torch.device("cpu")})()
    scale = DeepSpeedLossScale(engine)
    with fake_cuda():
        tensor = scale.scale_tensor("cuda")
        assert tensor.device.type == "cuda" and tensor.dim() == 0
    assert scale.get_scale() == 128.0


# --- every training method through each adapter: no host read beyond the trainer's own --------------
WINDOW = range(3, 5)  # steady state: after the first steps (one-time set-up reads), no measurement step


def _hf_window(tmp_path, config: dict | None, trainer: str = "trainer") -> StepWindow:
    from transformers import Trainer, TrainingArguments

    from aniso_plugins.integrations.hf import AnisoCallback
    from hf_utils import TokenDataset, tiny_gpt2

    window = StepWindow(WINDOW)
    callbacks = [hf_window(window)]
    if config is not None:
        callbacks.append(AnisoCallback(AnisoConfig(load_entry_points=False, **{"metrics": (), **config})))
    common = dict(output_dir=str(tmp_path), report_to="none", use_cpu=True, disable_tqdm=True, save_strategy="no",
                  per_device_train_batch_size=4, max_steps=WINDOW.stop, logging_steps=10_000, learning_rate=1e-3, seed=0)
    if trainer == "sft":
        import trl
        from datasets import Dataset

        from hf_utils import tiny_llama
        from word_data import VOCAB, texts, tokenizer

        args = trl.SFTConfig(**common, max_length=32, bf16=False)
        trl.SFTTrainer(model=tiny_llama(vocab=len(VOCAB), tied=False), args=args, processing_class=tokenizer(),
                       train_dataset=Dataset.from_dict({"text": texts(32)}), callbacks=callbacks).train()
    else:
        Trainer(model=tiny_gpt2(), args=TrainingArguments(**common), train_dataset=TokenDataset(n=64),
                callbacks=callbacks).train()
    return window


@pytest.fixture(scope="module")
def hf_plain(tmp_path_factory) -> StepWindow:
    return _hf_window(tmp_path_factory.mktemp("plain"), None)


@pytest.mark.parametrize("name", sorted(TRAINING_METHODS))
def test_no_training_method_adds_a_host_read_to_the_hf_trainers_step(tmp_path, hf_plain, name):
    """Before (benchmarks/host_syncs.py on the code before): AGG fused +14 per step, unfused +13,
    rare_fraction +14, alpha_tokens +15, the fused MLE loss +5, CosReg and spectrum +2, the hinge
    +5 (sampled +10), uniformity +5, the frequency metric +4."""
    window = _hf_window(tmp_path, TRAINING_METHODS[name])
    assert window.ours() == {} and window.per_step == hf_plain.per_step, (window.per_step, window.ours())


@pytest.mark.parametrize("name", ["agg", "cosreg"])
def test_no_host_read_through_trls_sft_trainer(tmp_path, name):
    plain = _hf_window(tmp_path / "plain", None, trainer="sft")
    window = _hf_window(tmp_path / name, TRAINING_METHODS[name], trainer="sft")
    assert window.ours() == {} and window.per_step == plain.per_step, (window.per_step, window.ours())


LIGHTNING_METHODS = ("agg", "agg_rare_fraction", "cosreg", "hinge", "spectrum", "lowrank", "simctg", "uniformity",
                     "frequency_metric", "mu_centering", "mu_loss")


def _lightning_window(tmp_path, config: dict | None) -> StepWindow:
    import lightning.pytorch as pl

    from aniso_plugins.integrations.lightning import AnisoCallback as LightningCallback
    from lightning_utils import LitLM, loader

    window = StepWindow(WINDOW)
    callbacks = [lightning_window(window)]
    if config is not None:
        callbacks.append(LightningCallback(AnisoConfig(load_entry_points=False, **{"metrics": (), **config}),
                                           head="model.lm_head", input_embedding="model.embed", blocks="model.blocks",
                                           targets="causal"))  # fmt: skip
    trainer = pl.Trainer(callbacks=callbacks, accelerator="cpu", devices=1, max_steps=WINDOW.stop, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir=str(tmp_path), num_sanity_val_steps=0, log_every_n_steps=10_000)  # fmt: skip
    trainer.fit(LitLM(), loader())
    return window


def test_no_training_method_adds_a_host_read_to_lightnings_step(tmp_path):
    plain = _lightning_window(tmp_path / "plain", None)
    for name in LIGHTNING_METHODS:
        window = _lightning_window(tmp_path / name, TRAINING_METHODS[name])
        assert window.ours() == {} and window.per_step == plain.per_step, (name, window.per_step, window.ours())


# --- the library's step on a fake GPU ----------------------------------------------------------------
FAKE_STEP_METHODS = ("agg", "agg_unfused", "agg_rare_fraction", "agg_alpha_tokens", "cosreg", "hinge", "hinge_sampled",
                     "spectrum", "lowrank", "agg_lowrank", "simctg", "uniformity", "uniformity_hidden", "frequency_metric")


class BlocksLM(nn.Module):
    """Embedding -> one linear block -> LM head, on `device` (the blocks for the hidden-state terms)."""

    def __init__(self, device: str, dtype: torch.dtype):
        super().__init__()
        self.embed = nn.Embedding(V, 8, device=device, dtype=dtype)
        self.blocks = nn.ModuleList([nn.Linear(8, 8, device=device, dtype=dtype)])
        self.lm_head = nn.Linear(8, V, bias=False, device=device, dtype=dtype)

    def forward(self, ids):
        return self.lm_head(torch.tanh(self.blocks[0](self.embed(ids))))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", FAKE_STEP_METHODS)
def test_the_session_step_runs_on_a_fake_cuda_device(name, dtype):
    """Set-up, the step's announcement, the micro-batch, the model's forward through the head with
    the method on (the gated or fused head, the loss terms attached in its forward, the activation
    terms) and the end of the step, three steps, on a model on the fake device: nothing reads back,
    nothing of the session's meets a host tensor."""
    once = {"spectrum_c1": 1.0} if name == "spectrum" else {}  # (without it σ₁ is read once, at the first call)
    config = AnisoConfig(load_entry_points=False, **{"metrics": (), **TRAINING_METHODS[name], **once})
    with fake_cuda():
        model = BlocksLM("cuda", dtype)
        session = TrainingSession(config)
        session.setup(ModelHandle(model, head="lm_head", input_embedding="embed", blocks="blocks"), owns_loss=True)
        session.begin_training()
        for step in (1, 2, 3):
            ids = torch.randint(0, V, (2, 6), device="cuda")
            targets = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1)
            if session.wants_step_targets:
                session.begin_step([targets], step=step)
            session.begin_micro_batch(targets, step=step, loss_normalizer=(targets != -100).sum())
            out = model(ids)
            assert out.device.type == "cuda"
            session.end_step(step)


def test_to_host_copies_every_tensor_at_once_with_its_dtype_and_shape():
    """`to_host`: one copy of mixed dtypes and shapes (float64 / int64 / float32 / int32 / bool,
    0-d to 2-d), each back with its own values; reading them is not a device read."""
    from aniso_plugins.numerics.host_copy import HOST_COPY_MARK, to_host

    values = {"a": torch.tensor(3.25, dtype=torch.float64), "b": torch.tensor([1, -2, 3]),
              "c": torch.tensor([True, False, True]), "d": torch.arange(6, dtype=torch.float32).reshape(2, 3),
              "e": torch.tensor(7, dtype=torch.int32)}
    with HostSyncs() as syncs:
        host = to_host(values)
        numbers = {k: v.tolist() for k, v in host.items()}
    assert syncs.total == 1  # the one copy (`.cpu()` of the packed bytes)
    assert numbers == {"a": 3.25, "b": [1, -2, 3], "c": [True, False, True], "d": [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]], "e": 7}
    assert all(host[k].dtype == v.dtype and host[k].shape == v.shape and getattr(host[k], HOST_COPY_MARK) for k, v in values.items())


@pytest.mark.slow
def test_a_measurement_reads_each_metric_family_back_at_once():
    """Host reads of one measurement per metric family (benchmarks/host_syncs.py --measurement,
    a copy to the host counting one): geometry two (the row count for the spectra's k, then every
    value), frequency two (the groups' sizes, then every value), every other family one batched
    copy. Before: geometry 55, frequency 30, under_trained 14, ethayarajh 11, eval 9, bottleneck 8,
    uniformity 7, hidden 2 (one per value read and per boolean selection)."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    import host_syncs

    import transformers

    transformers.logging.set_verbosity_error()
    most = {"geometry": 2, "frequency": 2, "hidden": 1, "bottleneck": 1, "uniformity": 1, "ethayarajh": 1,
            "under_trained": 1, "eval": 1}
    reads = {family: host_syncs.measurement(family) for family in most}
    assert all(per_call <= most[family] for family, (per_call, _) in reads.items()), reads
    assert reads["geometry"][0] == 2, reads["geometry"]
