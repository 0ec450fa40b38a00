"""The reliability suite: bad inputs fail clearly and leave the model as it was; monitoring never
takes a run down; state survives interruption (real HF Trainer and Lightning, tiny models).

Each case of the table is a way a user can get a run wrong at set-up. For each: the error type,
a fragment of its message, and the model after the error: the same Parameters (objects and
values), the same tying, the same forwards, the same config, as before the call.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import subprocess
import sys
import time

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from hf_utils import TokenDataset, tiny_gpt2, tiny_llama
from lightning_utils import LitLM, loader
from torch import nn
from transformers import Trainer, TrainingArguments

from aniso_plugins import AnisoConfig, ConfigError, ModelHandle, SetupError, StateError, TrainingSession, detach
from aniso_plugins.integrations.hf import AnisoCallback
from aniso_plugins.integrations.lightning import AnisoCallback as LightningCallback

HERE = os.path.dirname(os.path.abspath(__file__))
QUIET = dict(report_to="none", use_cpu=True, disable_tqdm=True, save_strategy="no", seed=0, data_seed=0)
PATHS = dict(head="model.lm_head", input_embedding="model.embed", blocks="model.blocks", targets="causal")


def cfg(**kw) -> AnisoConfig:
    return AnisoConfig(**{"metrics": (), "load_entry_points": False, **kw})


def fingerprint(model: nn.Module) -> dict:
    """What must not change: every Parameter (object and value), tying, forwards, hooks, config."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else model.model.lm_head
    config = getattr(model, "config", None)
    return {
        "params": [(name, id(p), p.detach().clone()) for name, p in model.named_parameters(remove_duplicate=False)],
        "head": id(head),
        "forwards": sorted(name for name, m in model.named_modules() if "forward" in m.__dict__),
        "hooks": sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()),
        "tie": None if config is None else config.tie_word_embeddings,
    }


def assert_unchanged(before: dict, model: nn.Module) -> None:
    after = fingerprint(model)
    assert [(n, i) for n, i, _ in after["params"]] == [(n, i) for n, i, _ in before["params"]]
    for (name, _, a), (_, _, b) in zip(after["params"], before["params"]):
        assert torch.equal(a, b), name
    assert {k: v for k, v in after.items() if k != "params"} == {k: v for k, v in before.items() if k != "params"}


class ScaledHead(nn.Linear):
    """A head whose forward is not a plain linear map (a logit scale)."""

    def forward(self, input):
        return 0.5 * F.linear(input, self.weight)


def scaled_head_model():
    model = tiny_gpt2()
    head = ScaledHead(16, model.config.vocab_size, bias=False)
    head.weight = model.transformer.wte.weight
    model.set_output_embeddings(head)
    return model


def transposed_head_model():
    class Transposed(nn.Module):
        def __init__(self, weight):
            super().__init__()
            self.weight = nn.Parameter(weight.detach().T.clone())

        def forward(self, input):
            return input @ self.weight

    model = tiny_gpt2()
    model.set_output_embeddings(Transposed(model.transformer.wte.weight))
    return model


# case: (model factory, config, error type, message fragment, whether a plain callback then works
# on the same model: not for a model aniso_plugins cannot read at all)
SETUP_CASES = {
    "agg-on-a-scaled-head": (scaled_head_model, cfg(method="agg", window=3), SetupError, "exactly F.linear", True),
    "head-stored-transposed": (transposed_head_model, cfg(method="agg", window=3), SetupError, "transpose", False),
    "lowrank-rank-d": (tiny_gpt2, cfg(head="lowrank", lowrank_rank=16), SetupError, "1 <= r < d = 16", True),
    "agg-lowrank-rank-d-tied-llama": (tiny_llama, cfg(method="agg", head="lowrank", lowrank_rank=16), SetupError, "r < d", True),
    "special-ids-outside-vocab": (
        tiny_gpt2, cfg(method="agg", window=3, special_ids=(64,)), ConfigError, "ids [64] are >= the vocabulary size 64", True,
    ),
    "reg-exclude-ids-outside-vocab": (
        tiny_gpt2, cfg(method="cosreg", reg_exclude_ids=(3, 99)), ConfigError, "ids [99] are >= the vocabulary size 64", True,
    ),
}


@pytest.mark.parametrize("case", sorted(SETUP_CASES))
def test_hf_setup_errors_leave_the_model_unchanged_and_a_retry_works(tmp_path, case):
    make, config, error, fragment, retry = SETUP_CASES[case]
    model = make()
    before = fingerprint(model)
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=4, **QUIET)
    with pytest.raises(error) as raised:
        Trainer(model=model, args=args, train_dataset=TokenDataset(), callbacks=[AnisoCallback(config)])
    assert fragment in str(raised.value)
    assert_unchanged(before, model)
    if retry:  # the retry with a valid configuration works on the same model (nothing left patched)
        Trainer(model=model, args=args, train_dataset=TokenDataset(), callbacks=[AnisoCallback(cfg())]).train()


def test_lightning_setup_error_leaves_the_model_unchanged(tmp_path):
    module = LitLM()
    before = fingerprint(module)
    cb = LightningCallback(cfg(method="agg", window=3, head="lowrank", lowrank_rank=16), **PATHS)
    trainer = pl.Trainer(accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[cb])
    with pytest.raises(SetupError, match="r < d"):
        trainer.fit(module, loader())
    assert_unchanged(before, module)


def test_config_errors_name_what_is_duplicated():
    with pytest.raises(ConfigError, match="'geometry' is listed twice in metrics"):
        AnisoConfig(metrics=("geometry", "geometry"))


@pytest.mark.parametrize(
    "kw, fragment",
    [
        (dict(method=("none", "simctg")), "cannot be combined"),
        (dict(method=("hinge", "spectrum")), "both regularize the head rows"),
        (dict(method=("simcse", "simctg")), "simcse trains sentence encoders"),
        (dict(update_efficiency=True, metrics=("geometry",)), "add 'bottleneck' to metrics"),
    ],
)
def test_configurations_that_cannot_work_fail_when_built(kw, fragment):
    with pytest.raises(ConfigError, match=fragment):
        AnisoConfig(**kw)


def test_simcse_without_its_collator_fails_before_the_first_update(tmp_path):
    from transformers import BertConfig, BertForMaskedLM

    class Sentences(TokenDataset):  # no labels, and every row a different sentence
        def __getitem__(self, i):
            return {"input_ids": self.ids[i], "attention_mask": torch.ones_like(self.ids[i])}

    model = BertForMaskedLM(BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                       intermediate_size=32, max_position_embeddings=64))
    before = fingerprint(model)
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=4, **QUIET)
    trainer = Trainer(model=model, args=args, train_dataset=Sentences(), callbacks=[AnisoCallback(cfg(method="simcse"))])
    with pytest.raises(ConfigError, match="SimCSECollator"):
        trainer.train()
    for (name, _, a), (_, _, b) in zip(fingerprint(model)["params"], before["params"]):
        assert torch.equal(a, b), name  # no step was taken


# --- silently wrong runs now raise ---------------------------------------------------------------
def test_a_second_callback_that_changes_the_head_is_refused_and_a_replaced_head_stops_agg(tmp_path):
    model = tiny_gpt2()
    before = fingerprint(model)
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=4, **QUIET)
    agg = AnisoCallback(cfg(method="agg", window=3))
    with pytest.raises(SetupError, match="one AnisoCallback per Trainer"):
        Trainer(model=model, args=args, train_dataset=TokenDataset(),
                callbacks=[agg, AnisoCallback(cfg(head="lowrank", lowrank_rank=4))])
    assert_unchanged(before, model)  # neither callback set anything up: no detach needed to retry
    Trainer(model=model, args=args, train_dataset=TokenDataset(), callbacks=[agg]).train()
    agg.detach()
    # whatever replaces the head after AGG's set-up, AGG refuses to run as if it gated it
    from aniso_plugins import LowRankHead, OutputEmbeddingsHandle

    session = TrainingSession(cfg(method="agg", window=3))
    handle = OutputEmbeddingsHandle(model)
    session.setup(handle)
    model.set_output_embeddings(LowRankHead.from_linear(model.lm_head, 4))
    with pytest.raises(SetupError, match="something replaced it after AGG's set-up"):
        session.begin_training()


def test_the_same_model_in_a_second_trainer_needs_detach_and_then_works(tmp_path):
    model = tiny_gpt2()
    before = fingerprint(model)
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=4, **QUIET)
    first = AnisoCallback(cfg(method="agg", window=3, head="untie"))
    Trainer(model=model, args=args, train_dataset=TokenDataset(), callbacks=[first])
    assert model.config.tie_word_embeddings is False
    with pytest.raises(SetupError, match=r"already has an aniso training forward installed.*detach"):
        Trainer(model=model, args=args, train_dataset=TokenDataset(),
                callbacks=[AnisoCallback(cfg(method="agg", window=3))])
    first.detach()
    assert_unchanged(before, model)  # tying, Parameters, forwards and hooks as they were
    second = AnisoCallback(cfg(method="agg", window=3))
    Trainer(model=model, args=args, train_dataset=TokenDataset(), callbacks=[second]).train()
    assert detach(model) == 1 and fingerprint(model)["forwards"] == []  # the module-level way out


def test_lightning_teardown_detaches_so_the_model_fits_again(tmp_path):
    module = LitLM()
    kw = dict(accelerator="cpu", max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
              enable_model_summary=False)
    for _ in range(2):
        pl.Trainer(callbacks=[LightningCallback(cfg(method="agg", window=3), **PATHS)], **kw).fit(module, loader())
        assert fingerprint(module)["forwards"] == []


def test_agg_refuses_float_labels(tmp_path):
    class FloatLabels(TokenDataset):
        def __getitem__(self, i):
            item = super().__getitem__(i)
            return {"input_ids": item["input_ids"], "labels": item["labels"].float()}

    args = TrainingArguments(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=4, **QUIET)
    trainer = Trainer(model=tiny_gpt2(), args=args, train_dataset=FloatLabels(),
                      callbacks=[AnisoCallback(cfg(method="agg", window=3))])
    with pytest.raises(SetupError, match="torch.float32, not integer token ids"):
        trainer.train()


def test_a_loop_that_splits_a_step_without_announcing_it_is_refused():
    """A hand-written loop on the session API: several micro-batches of a step announced without
    `begin_step` would gate each with partial counts (another method than one batch): refused
    at the first one, naming the call; announced, the step runs with one set of gates."""
    model = LitLM().model
    session = TrainingSession(cfg(method="agg", alpha=0.5, window=2))
    session.setup(ModelHandle(model, head="lm_head", input_embedding="embed"))
    session.begin_training(accumulation_steps=2)
    ids = torch.randint(0, 64, (2, 6))
    with pytest.raises(SetupError, match=r"step 1 has 2 micro-batches.*TrainingSession.begin_step"):
        session.begin_micro_batch(ids, step=1, accumulation_steps=2)
    session.begin_step([ids, ids.flip(0)], step=1)
    gates = []
    for part in (ids, ids.flip(0)):
        session.begin_micro_batch(part, step=1, accumulation_steps=2)
        gates.append(session.plugins.get("agg").last_gates)
        F.cross_entropy(model(part).reshape(-1, 64), part.reshape(-1)).backward()
    session.end_step(1)
    assert gates[0] is gates[1]


def test_lightning_training_step_on_the_dataloader_iterator_is_refused(tmp_path):
    """The callback reads each batch's targets before its forward (AGG: every batch of an optimizer
    step before the first); a training_step that takes the dataloader iterator fetches them
    itself: refused before the first forward, the model as it was."""

    class IterStep(LitLM):
        def training_step(self, dataloader_iter):
            batch, _, _ = next(dataloader_iter)
            return self._loss(batch)

    trainer = pl.Trainer(callbacks=[LightningCallback(cfg(method="agg", window=3), **PATHS)], accelerator="cpu",
                         devices=1, max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=str(tmp_path), accumulate_grad_batches=2)  # fmt: skip
    module = IterStep()
    before = module.model.lm_head.weight.detach().clone()
    with pytest.raises(SetupError, match="training_step takes the dataloader iterator.*take `batch` in training_step"):
        trainer.fit(module, loader())
    assert torch.equal(module.model.lm_head.weight, before)  # no update happened


# --- monitoring never takes a run down --------------------------------------------------------------
def test_nonfinite_head_weights_give_nan_metrics_a_count_and_one_warning(tmp_path, caplog):
    model = tiny_gpt2()
    with torch.no_grad():
        model.lm_head.weight[5, 3] = float("nan")
        model.lm_head.weight[7, 0] = float("inf")
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=3, logging_steps=1, per_device_train_batch_size=4,
                             learning_rate=0.0, **QUIET)
    cb = AnisoCallback(cfg(metrics=("geometry", "frequency")))
    trainer = Trainer(model=model, args=args, train_dataset=TokenDataset(), callbacks=[cb])
    with caplog.at_level(logging.WARNING, logger="aniso_plugins"):
        trainer.train()  # plain HF keeps going, and so does it with the callback
    assert trainer.state.global_step == 3
    records = [r for r in trainer.state.log_history if "aniso/geometry/head/nonfinite" in r]
    counts = [r["aniso/geometry/head/nonfinite"] for r in records]
    assert len(counts) == 3 and all(c > 0 for c in counts)  # the NaN spreads through the updates
    assert counts[-1] == float((~torch.isfinite(model.lm_head.weight)).sum())  # counted independently
    assert all(math.isnan(r["aniso/geometry/head/isotropy"]) for r in records)
    warnings = [r for r in caplog.records if "non-finite" in r.getMessage()]
    assert len(warnings) == 1 and f"head weight has {int(counts[0])} non-finite entries" in warnings[0].getMessage()


# --- state files ------------------------------------------------------------------------------------
def _saved_state(tmp_path) -> str:
    session = TrainingSession(cfg(method="agg", window=4))
    model = tiny_gpt2()
    session.setup(__import__("aniso_plugins").OutputEmbeddingsHandle(model))
    session.begin_training()
    for step in (1, 2, 3):
        session.begin_micro_batch(torch.randint(0, 64, (2, 5)), step=step)
        model.train()
        model(input_ids=torch.randint(0, 64, (2, 5)))  # the gated head consumes the targets
        session.end_step(step)
    return session.save(tmp_path)


def _fresh_session(**kw) -> TrainingSession:
    session = TrainingSession(cfg(method="agg", window=4, **kw))
    session.setup(__import__("aniso_plugins").OutputEmbeddingsHandle(tiny_gpt2()))
    session.begin_training()
    return session


@pytest.mark.parametrize(
    "damage, fragment",
    [
        ("truncate", "not a readable aniso_plugins state file"),
        ("empty", "not a readable aniso_plugins state file"),
        ("garbage", "not a readable aniso_plugins state file"),
        ("tamper", "the saved state cannot be used"),
    ],
)
def test_every_state_load_failure_is_a_state_error_naming_the_file_and_the_way_out(tmp_path, damage, fragment):
    path = _saved_state(tmp_path)
    if damage == "tamper":
        from safetensors.torch import load_file, save_file
        from safetensors import safe_open

        with safe_open(path, framework="pt") as f:
            meta = f.metadata()
        tensors = load_file(path)
        tensors["agg/sizes"] = tensors["agg/sizes"] + 3
        save_file(tensors, path, metadata=meta)
    else:
        data = open(path, "rb").read()
        open(path, "wb").write({"truncate": data[: len(data) // 2], "empty": b"", "garbage": os.urandom(300)}[damage])
    with pytest.raises(StateError) as raised:
        _fresh_session().load(tmp_path)
    message = str(raised.value)
    assert path in message and fragment in message and "on_state_mismatch='reset'" in message
    fresh = _fresh_session(on_state_mismatch="reset")
    assert fresh.load(tmp_path)  # the documented way out: a warning, fresh counters
    assert int(fresh.plugins.get("agg").counter.counts().sum()) == 0


def test_stale_temporary_files_are_removed(tmp_path):
    _saved_state(tmp_path)
    stale = tmp_path / f"{TrainingSession.STATE_FILE}.tmp12345"
    stale.write_bytes(b"half")
    assert _fresh_session().load(tmp_path) and not stale.exists()


def _hf_agg_run(output, batch_size, max_steps, resume=False, **config):
    args = TrainingArguments(output_dir=str(output), max_steps=max_steps, per_device_train_batch_size=batch_size,
                             save_strategy="steps", save_steps=4, learning_rate=1e-2, **{k: v for k, v in QUIET.items() if k != "save_strategy"})
    cb = AnisoCallback(cfg(method="agg", **config))
    Trainer(model=tiny_gpt2(), args=args, train_dataset=TokenDataset(n=32), callbacks=[cb]).train(
        resume_from_checkpoint=True if resume else None
    )
    return cb


def test_resume_after_a_batch_size_change_recuts_the_epoch_window(tmp_path, caplog):
    # window=None: one epoch = 8 steps at batch size 4, 16 steps at batch size 2
    _hf_agg_run(tmp_path, batch_size=2, max_steps=4)
    with caplog.at_level(logging.WARNING, logger="aniso_plugins"):
        cb = _hf_agg_run(tmp_path, batch_size=4, max_steps=6, resume=True)
    assert "window K=16, this run K=8" in caplog.text
    assert cb.session.plugins.get("agg").counter.window == 8


def test_resume_with_a_window_that_cannot_be_recut_names_the_way_out(tmp_path):
    _hf_agg_run(tmp_path, batch_size=4, max_steps=8, window=3)
    with pytest.raises(StateError, match="window=6 needs 5.*on_state_mismatch='reset'"):
        _hf_agg_run(tmp_path, batch_size=4, max_steps=9, resume=True, window=6)
    cb = _hf_agg_run(tmp_path, batch_size=4, max_steps=9, resume=True, window=6, on_state_mismatch="reset")
    assert cb.session.plugins.get("agg").counter.step_index == 2  # fresh counter: one step counted


# --- every metric plugin under gradient accumulation -----------------------------------------------
ALL_METRICS = ("geometry", "frequency", "hidden", "bottleneck")


def _finite_metric_keys(record: dict) -> set[str]:
    return {k for k, v in record.items() if k.startswith("aniso/") and isinstance(v, float) and math.isfinite(v)}


def test_every_metric_under_accumulation_hf(tmp_path):
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=2, logging_steps=1, per_device_train_batch_size=2,
                             gradient_accumulation_steps=2, **QUIET)
    trainer = Trainer(model=tiny_gpt2(), args=args, train_dataset=TokenDataset(),
                      callbacks=[AnisoCallback(cfg(metrics=ALL_METRICS))])
    trainer.train()
    keys = _finite_metric_keys(next(r for r in trainer.state.log_history if "loss" in r))
    assert "aniso/hidden/layer_0/mean_cosine" in keys and "aniso/bottleneck/lost_fraction" in keys


def test_every_metric_under_accumulation_lightning(tmp_path):
    from lightning.pytorch.loggers import CSVLogger
    import csv

    trainer = pl.Trainer(accelerator="cpu", max_steps=2, log_every_n_steps=1, accumulate_grad_batches=2,
                         logger=CSVLogger(str(tmp_path)), enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[LightningCallback(cfg(metrics=ALL_METRICS), **PATHS)])
    trainer.fit(LitLM(), loader())
    rows = list(csv.DictReader(open(os.path.join(trainer.logger.log_dir, "metrics.csv"))))
    values = {k: float(v) for row in rows for k, v in row.items() if k.startswith("aniso/") and v not in ("", None)}
    assert math.isfinite(values["aniso/hidden/layer_0/mean_cosine"])  # NaN before the fix
    assert "aniso/bottleneck/lost_fraction" in values  # missing before the fix


# --- a kill at any instant of a save ----------------------------------------------------------------
KILL_SCRIPT = os.path.join(HERE, "hf_kill_script.py")


def _run_script(*args, timeout=300):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, KILL_SCRIPT, *args], env=env, timeout=timeout, capture_output=True, text=True)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out = tmp_path_factory.mktemp("straight")
    done = _run_script(str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    return torch.load(out / "final.pt")


@pytest.mark.slow
@pytest.mark.parametrize("point", ["state-tmp", "model-save", "rotate", "after-rotate"])
def test_hf_kill_during_a_save_leaves_the_newest_complete_checkpoint_resumable_with_its_state(tmp_path, point, uninterrupted):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen([sys.executable, KILL_SCRIPT, str(tmp_path), "--pause-at", point, "--pause-step", "6"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 240
    while not (tmp_path / "paused").exists():
        assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
        assert time.time() < deadline, "the run never reached the pause point"
        time.sleep(0.2)
    os.kill(proc.pid, signal.SIGKILL)  # the real thing: no handler, no cleanup
    proc.wait()
    resumed = _run_script(str(tmp_path), "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "counters start empty" not in resumed.stderr
    final = torch.load(tmp_path / "final.pt")
    for name, value in uninterrupted["params"].items():
        assert torch.equal(final["params"][name], value), name
    for key, value in uninterrupted["state"]["agg"].items():
        assert torch.equal(final["state"]["agg"][key], value), key


LIGHTNING_KILL_SCRIPT = os.path.join(HERE, "lightning_kill_script.py")


@pytest.mark.slow
def test_lightning_kill_during_a_save_leaves_a_checkpoint_with_its_own_state(tmp_path):
    """Lightning writes the callback's state inside the checkpoint file, atomically (fsspec
    transaction), and deletes the previous checkpoint only after: at each point a kill leaves
    one complete checkpoint whose plugin state belongs to it."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]))
    straight = subprocess.run([sys.executable, LIGHTNING_KILL_SCRIPT, str(tmp_path / "straight")], env=env,
                              timeout=300, capture_output=True, text=True)
    assert straight.returncode == 0, straight.stderr[-3000:]
    reference = torch.load(tmp_path / "straight" / "final.pt")
    for point in ("write", "remove", "after-remove"):
        out = tmp_path / point
        out.mkdir()
        proc = subprocess.Popen([sys.executable, LIGHTNING_KILL_SCRIPT, str(out), "--pause-at", point], env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.time() + 240
        while not (out / "paused").exists():
            assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
            assert time.time() < deadline, f"{point}: the run never reached the pause point"
            time.sleep(0.2)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        resumed = subprocess.run([sys.executable, LIGHTNING_KILL_SCRIPT, str(out), "--resume"], env=env,
                                 timeout=300, capture_output=True, text=True)
        assert resumed.returncode == 0, (point, resumed.stderr[-3000:])
        final = torch.load(out / "final.pt")
        for name, value in reference["params"].items():
            assert torch.equal(final["params"][name], value), (point, name)
        for key, value in reference["state"]["agg"].items():
            assert torch.equal(final["state"]["agg"][key], value), (point, key)
