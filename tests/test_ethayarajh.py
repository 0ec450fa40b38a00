"""Ethayarajh 2019 contextuality metrics (self-similarity, intra-sentence similarity, anisotropy
baseline; `aniso_plugins.metrics.ethayarajh.stats` and the "ethayarajh" metric plugin) against float64
references written here with explicit loops over occurrences, pairs and sentences: on small
tensors (repeated tokens across sentences, padding, zero vectors, a binding word cap), driven
through `AnisoPlugins` (causal fallback for the token ids, gradient accumulation), through a
real transformers.Trainer on a 2-block GPT-2, and on 2 gloo ranks under DDP and FSDP2."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from aniso_plugins import AnisoConfig, AnisoPlugins, ModelHandle, SetupError, StepInfo
from aniso_plugins.metrics.ethayarajh.stats import (
    choose_words,
    layer_finish,
    layer_stats,
    token_positions,
    word_counts,
)
from dist_utils import run_distributed

IGNORE = -100
KEYS = ("self_sim", "self_sim_adjusted", "intra_sim", "intra_sim_adjusted", "baseline")


# --- references ------------------------------------------------------------------------------
def _cos(a: np.ndarray, b: np.ndarray) -> float:
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def ref_occurrences(ids: np.ndarray, counted: np.ndarray) -> dict[int, list[tuple[int, int]]]:
    """token id -> its counted positions (s, i) with a known id, in order."""
    occ: dict[int, list[tuple[int, int]]] = {}
    for s in range(ids.shape[0]):
        for i in range(ids.shape[1]):
            if counted[s, i] and ids[s, i] >= 0:
                occ.setdefault(int(ids[s, i]), []).append((s, i))
    return occ


def ref_words(occ: dict[int, list], cap: int) -> tuple[list[int], set[int]]:
    """(chosen words, repeated words beyond the cap): repeated = at least two occurrences,
    ordered by count descending then id ascending."""
    repeated = sorted((w for w in occ if len(occ[w]) >= 2), key=lambda w: (-len(occ[w]), w))
    return repeated[:cap], set(repeated[cap:])


def ref_layer(hidden: np.ndarray, ids: np.ndarray, counted: np.ndarray, cap: int) -> dict[str, float]:
    """Per-layer metrics by explicit loops: hidden (S, T, d), ids (S, T) with -1 unknown,
    counted (S, T) bool; zero vectors are skipped."""
    h = hidden.astype(np.float64)
    occ = ref_occurrences(ids, counted)
    chosen, beyond = ref_words(occ, cap)

    def nonzero(p):
        return np.linalg.norm(h[p]) > 0

    per_word = []
    for w in chosen:
        ps = [p for p in occ[w] if nonzero(p)]
        if len(ps) >= 2:
            pairs = [_cos(h[a], h[b]) for j, a in enumerate(ps) for k, b in enumerate(ps) if j != k]
            per_word.append(sum(pairs) / len(pairs))
    self_sim = sum(per_word) / len(per_word) if per_word else math.nan

    tokens = [(p, w) for w in occ for p in occ[w] if nonzero(p)]
    pair_values = [
        _cos(h[a], h[b])
        for a, wa in tokens
        for b, wb in tokens
        if wa != wb and not (wa in beyond and wb in beyond)
    ]
    baseline = sum(pair_values) / len(pair_values) if pair_values else math.nan

    intra = []
    for s in range(h.shape[0]):
        positions = [i for i in range(h.shape[1]) if counted[s, i]]
        if not positions:
            continue
        mean = sum(h[s, i] for i in positions) / len(positions)
        vectors = [i for i in positions if nonzero((s, i))]
        if len(vectors) >= 2 and np.linalg.norm(mean) > 0:
            intra.append(sum(_cos(mean, h[s, i]) for i in vectors) / len(vectors))
    intra_sim = sum(intra) / len(intra) if intra else math.nan
    return {
        "self_sim": self_sim,
        "self_sim_adjusted": self_sim - baseline,
        "intra_sim": intra_sim,
        "intra_sim_adjusted": intra_sim - baseline,
        "baseline": baseline,
    }


def ref_pair_share(occ: dict[int, list], cap: int) -> float:
    """Share of ordered different-word occurrence pairs not having both words beyond the cap."""
    _, beyond = ref_words(occ, cap)
    flat = [w for w in occ for _ in occ[w]]
    total = kept = 0
    for j, a in enumerate(flat):
        for k, b in enumerate(flat):
            if j != k and a != b:
                total += 1
                kept += not (a in beyond and b in beyond)
    return kept / total


def ref_positions(targets, input_ids, mask, vocab):
    """The ids and counted mask of `token_positions`, by loops."""
    s_count, t_count = targets.shape
    ids = np.full((s_count, t_count), -1)
    counted = np.zeros((s_count, t_count), dtype=bool)
    for s in range(s_count):
        for t in range(t_count):
            counted[s, t] = mask[s, t] != 0 if mask is not None else targets[s, t] != IGNORE
            if input_ids is not None:
                token = input_ids[s, t]
            else:
                token = targets[s, t - 1] if t > 0 else -1
            if counted[s, t] and 0 <= token < vocab:
                ids[s, t] = token
    return ids, counted


def assert_metrics(got: dict[str, float], ref: dict[str, float], where: str, rtol=1e-9, atol=1e-12) -> None:
    for key in KEYS:
        assert got[key] == pytest.approx(ref[key], rel=rtol, abs=atol, nan_ok=True), f"{where} {key}: {got[key]} vs {ref[key]}"


# --- the math on small tensors ---------------------------------------------------------------
def _small_case(seed: int = 0):
    """5 sentences of 7 positions, d = 5, 6 token ids (repeats within and across sentences),
    padding holding garbage (NaN), zero vectors at counted positions (id 5 has two
    occurrences, both zero), a sentence with a single counted vector, an unknown id."""
    g = np.random.default_rng(seed)
    hidden = g.normal(size=(5, 7, 5)) + np.array([1.5, 0.5, 0.0, 0.0, -0.3])
    ids = np.array(
        [
            [0, 1, 2, 0, 3, 1, 4],
            [-1, 1, 0, 5, 2, 0, 3],  # -1: a position whose token is unknown (in IntraSim only)
            [2, 4, 4, 4, 0, 1, 5],
            [3, 0, 2, 1, 0, 4, 4],
            [4, 2, 1, 3, 0, 0, 0],
        ]
    )
    counted = np.ones(ids.shape, dtype=bool)
    counted[3, 4:] = False
    counted[4, 1:] = False  # sentence 4: one counted vector, no IntraSim
    hidden[3, 5] = np.nan  # padding may hold anything
    hidden[0, 2] = 0.0  # a zero vector of a repeated word
    hidden[1, 3] = hidden[2, 6] = 0.0  # both occurrences of id 5
    return hidden, ids, counted


def _inputs(ids: np.ndarray, counted: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """ids and counted as `token_positions` hands them over: -1 where not counted."""
    return torch.from_numpy(np.where(counted, ids, -1)), torch.from_numpy(counted)


def _finish(parts, prefix=""):
    """Sum the `layer_stats` of several parts (what reduce_stats does across ranks), finish."""
    reduced = {}
    for part in parts:
        for name, stat in part.items():
            reduced[name] = reduced[name] + stat.value if name in reduced else stat.value.clone()
    return layer_finish(reduced, prefix)


@pytest.mark.parametrize("cap", [256, 2])
def test_layer_metrics_equal_pairwise_reference(cap):
    hidden, ids, counted = _small_case()
    ref = ref_layer(hidden, ids, counted, cap)
    assert all(math.isfinite(v) for v in ref.values())
    t_ids, t_counted = _inputs(ids, counted)
    words = choose_words(word_counts(t_ids, 6), cap)
    occ = ref_occurrences(ids, counted)
    chosen, beyond = ref_words(occ, cap)
    assert words.words.tolist() == chosen and words.repeated == len(chosen) + len(beyond)
    assert (len(beyond) > 0) == (cap == 2)  # the small cap binds
    # float32 hidden states (what a model gives): unit vectors and sums in float64
    x = torch.from_numpy(hidden).float()
    got = _finish([layer_stats(x, t_ids, t_counted, words)])
    assert_metrics(got, ref_layer(x.double().numpy(), ids, counted, cap), f"cap={cap}", rtol=1e-6, atol=1e-7)
    got = _finish([layer_stats(torch.from_numpy(hidden), t_ids, t_counted, words)])
    assert_metrics(got, ref, f"cap={cap} float64")
    # split into two "ranks" by sentences: the summed statistics give the same metrics
    parts = [layer_stats(torch.from_numpy(hidden[a:b]), t_ids[a:b], t_counted[a:b], words) for a, b in ((0, 2), (2, 5))]
    assert_metrics(_finish(parts), ref, f"cap={cap} split")


def test_baseline_pair_share_and_word_choice():
    from aniso_plugins.metrics.ethayarajh.stats import baseline_pair_share

    _, ids, counted = _small_case()
    occ = ref_occurrences(ids, counted)
    counts = word_counts(_inputs(ids, counted)[0], 6)
    assert counts.tolist() == [len(occ.get(w, [])) for w in range(6)]
    for cap in (1, 2, 3, 256):
        words = choose_words(counts, cap)
        assert baseline_pair_share(counts, words) == pytest.approx(ref_pair_share(occ, cap), rel=1e-12)
    assert baseline_pair_share(counts, choose_words(counts, 256)) == 1.0
    # ties by the smaller id; slots: chosen rank, then "beyond the cap", then "seen at most once"
    words = choose_words(torch.tensor([2, 5, 2, 1, 5, 0, 2]), 3)
    assert words.words.tolist() == [1, 4, 0] and words.repeated == 5
    assert words.slots.tolist() == [2, 0, 3, 4, 1, 4, 3]
    with pytest.raises(ValueError, match="ethayarajh_words"):
        choose_words(counts, 0)


def test_token_positions_mask_input_ids_and_causal_fallback():
    g = torch.Generator().manual_seed(1)
    targets = torch.randint(0, 9, (3, 6), generator=g)
    targets[0, 2] = IGNORE
    targets[:, -1] = IGNORE
    input_ids = torch.randint(0, 9, (3, 6), generator=g)
    input_ids[1, 3] = 12  # outside the vocabulary
    mask = torch.ones(3, 6, dtype=torch.int64)
    mask[2, 4:] = 0
    for given_ids, given_mask in ((input_ids, mask), (input_ids, None), (None, mask), (None, None)):
        ids, counted = token_positions(targets, given_ids, given_mask, IGNORE, vocab_size=10)
        ref_ids, ref_counted = ref_positions(
            targets.numpy(), None if given_ids is None else given_ids.numpy(),
            None if given_mask is None else given_mask.numpy(), 10,
        )
        assert np.array_equal(ids.numpy(), ref_ids) and np.array_equal(counted.numpy(), ref_counted)
    with pytest.raises(ValueError, match="input_ids"):
        token_positions(targets, input_ids[:, :3])


def test_non_finite_counted_entry_makes_the_layer_nan():
    hidden, ids, counted = _small_case()
    hidden[1, 2, 0] = np.inf  # a counted position
    t_ids, t_counted = _inputs(ids, counted)
    stats = layer_stats(torch.from_numpy(hidden), t_ids, t_counted, choose_words(word_counts(t_ids, 6), 256))
    assert float(stats["nonfinite"].value) == 1.0
    assert all(math.isnan(v) for v in _finish([stats]).values())


# --- through AnisoPlugins (the causal fallback of torchtitan) -------------------------------
V, D, LAYERS = 13, 6, 2


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x):
        return x + torch.tanh(self.lin(x))


class LM(nn.Module):
    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(V, D)
        self.blocks = nn.ModuleList([Block() for _ in range(LAYERS)])
        self.norm = nn.LayerNorm(D)
        self.lm_head = nn.Linear(D, V, bias=False)
        with torch.no_grad():
            self.embed.weight.add_(0.6)

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.norm(x))


def lm_batch(seed: int, b: int = 3, t: int = 8):
    """Skewed ids (repeats across sentences), causal targets, padding at the end of one row."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.multinomial(torch.linspace(1.0, 0.1, V) ** 2, b * t, replacement=True, generator=g).reshape(b, t)
    mask = torch.ones(b, t, dtype=torch.int64)
    mask[b - 1, t - 3 :] = 0
    labels = ids.masked_fill(mask == 0, IGNORE)
    targets = torch.cat([labels[:, 1:], torch.full((b, 1), IGNORE)], dim=1)
    return ids, mask, targets


def _block_outputs(model) -> dict[int, list[torch.Tensor]]:
    seen: dict[int, list[torch.Tensor]] = {i: [] for i in range(LAYERS)}
    for i, block in enumerate(model.blocks):
        block.register_forward_hook(lambda m, a, out, i=i: seen[i].append(out.detach().clone()))
    return seen


def test_plugin_measures_the_first_micro_batch_with_the_causal_fallback():
    model = LM().double()
    cap = 3
    plugins = AnisoPlugins(AnisoConfig(metrics=("ethayarajh",), ethayarajh_words=cap, load_entry_points=False))
    plugins.setup(ModelHandle(model, head="lm_head", input_embedding="embed", blocks="blocks"))
    seen = _block_outputs(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    metrics = {}
    for step in (1, 2):
        for mb in range(2):
            ids, _, targets = lm_batch(10 * step + mb)
            info = StepInfo(step=step, micro_batch=mb, accumulation_steps=2, measure=step == 2)
            plugins.targets(targets, info)  # no input_ids: the torchtitan case
            F.cross_entropy(model(ids).reshape(-1, V), targets.reshape(-1), ignore_index=IGNORE).backward()
        opt.step()
        opt.zero_grad()
        plugins.step_end(StepInfo(step=step, accumulation_steps=2))
        metrics[step] = plugins.measure(StepInfo(step=step, measure=True))
    # step 1 was not a measurement step: nothing was recorded
    assert all(math.isnan(metrics[1][f"aniso/ethayarajh/layer_{i}/{k}"]) for i in range(LAYERS) for k in KEYS)
    assert metrics[1]["aniso/ethayarajh/words"] == 0.0
    # step 2: micro-batch 0 (the 3rd forward), ids = previous targets, counted = targets not ignored
    ids, _, targets = lm_batch(20)
    ref_ids, counted = ref_positions(targets.numpy(), None, None, V)
    occ = ref_occurrences(ref_ids, counted)
    chosen, beyond = ref_words(occ, cap)
    assert beyond, "the cap must bind in this case"
    got = metrics[2]
    assert got["aniso/ethayarajh/words"] == len(chosen)
    assert got["aniso/ethayarajh/repeated_words"] == len(chosen) + len(beyond)
    assert got["aniso/ethayarajh/baseline_pair_share"] == pytest.approx(ref_pair_share(occ, cap), rel=1e-12)
    for i in range(LAYERS):
        ref = ref_layer(seen[i][2].numpy(), ref_ids, counted, cap)
        assert_metrics({k: got[f"aniso/ethayarajh/layer_{i}/{k}"] for k in KEYS}, ref, f"layer {i}")


@pytest.mark.parametrize("fault", ["nonfinite", "shape"])
def test_plugin_reports_nan_for_a_faulty_layer_and_warns_once(fault, caplog):
    model = LM().double()
    plugins = AnisoPlugins(AnisoConfig(metrics=("ethayarajh",), load_entry_points=False))
    plugins.setup(ModelHandle(model, head="lm_head", input_embedding="embed", blocks="blocks"))
    seen = _block_outputs(model)

    def spoil(module, args, out):  # runs before the plugin's hook (prepended)
        if fault == "shape":
            return out.reshape(-1, D)  # e.g. a packed or sequence-sharded layout
        out = out.clone()
        out[0, 1, 0] = math.nan  # a counted position
        return out

    model.blocks[1].register_forward_hook(spoil, prepend=True)
    ids, mask, targets = lm_batch(5)
    with caplog.at_level("WARNING", logger="aniso_plugins"):
        for step in (1, 2):
            plugins.targets(targets, StepInfo(step=step, measure=True, input_ids=ids, attention_mask=mask))
            model(ids)
            plugins.step_end(StepInfo(step=step))
            got = plugins.measure(StepInfo(step=step, measure=True))
    assert caplog.text.count("aniso_plugins ethayarajh") == 1
    assert ("non-finite" if fault == "nonfinite" else "not (..., T, d)") in caplog.text
    assert all(math.isnan(got[f"aniso/ethayarajh/layer_1/{k}"]) for k in KEYS)
    ref_ids, counted = ref_positions(targets.numpy(), ids.numpy(), mask.numpy(), V)
    ref = ref_layer(seen[0][-1].numpy(), ref_ids, counted, 256)  # the healthy layer is measured
    assert_metrics({k: got[f"aniso/ethayarajh/layer_0/{k}"] for k in KEYS}, ref, "layer 0")


def test_plugin_needs_blocks():
    plugins = AnisoPlugins(AnisoConfig(metrics=("ethayarajh",), load_entry_points=False))
    with pytest.raises(SetupError, match="blocks="):
        plugins.setup(ModelHandle(LM(), head="lm_head"))


# --- a real transformers.Trainer ------------------------------------------------------------
HF_V, HF_T = 40, 12


def gpt2(layers: int = 2):
    """tests/hf_utils.tiny_gpt2 with two blocks (the last block's output differs from
    output_hidden_states' last entry, which is after ln_f). transformers is imported here, not
    at module level, so that the 2-rank workers (which import this module) start fast."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(
        n_layer=layers, n_embd=16, n_head=2, vocab_size=HF_V, n_positions=32, bos_token_id=0, eos_token_id=0,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )
    model = GPT2LMHeadModel(cfg)
    model.loss_type = "ForCausalLM"
    return model


class PaddedDataset(torch.utils.data.Dataset):
    """Zipf-like ids, right padding (pad id 0) marked in attention_mask and labels."""

    def __init__(self, n: int = 32):
        g = torch.Generator().manual_seed(5)
        p = 1.0 / torch.arange(1, HF_V + 1, dtype=torch.float64)
        self.ids = torch.multinomial(p, n * HF_T, replacement=True, generator=g).view(n, HF_T)
        self.lengths = torch.randint(HF_T - 4, HF_T + 1, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int):
        mask = (torch.arange(HF_T) < self.lengths[i]).long()
        ids = self.ids[i].masked_fill(mask == 0, 0)
        return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, IGNORE)}


def test_hf_trainer_logs_the_reference_of_the_measured_micro_batch(tmp_path):
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from aniso_plugins.integrations.hf import AnisoCallback

    class Snapshots(TrainerCallback):
        """The model's weights at the beginning of each optimizer step."""

        def __init__(self):
            self.states = []
            self.model = None

        def on_train_begin(self, args, state, control, model=None, **kwargs):
            self.model = model

        def on_step_begin(self, args, state, control, **kwargs):
            self.states.append(copy.deepcopy(self.model.state_dict()))

    model = gpt2()
    inputs, outputs = [], {i: [] for i in range(2)}
    model.register_forward_pre_hook(
        lambda m, a, kw: inputs.append({k: kw[k].clone() for k in ("input_ids", "attention_mask")}) if m.training else None,
        with_kwargs=True,
    )
    for i, block in enumerate(model.transformer.h):
        block.register_forward_hook(
            lambda m, a, out, i=i: outputs[i].append(out.detach().clone()) if m.training else None
        )
    snaps = Snapshots()
    cap = 3
    args = TrainingArguments(
        output_dir=str(tmp_path), report_to="none", use_cpu=True, disable_tqdm=True, save_strategy="no", seed=0,
        data_seed=0, per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=2, logging_steps=2,
        learning_rate=1e-2,
    )
    cb = AnisoCallback(AnisoConfig(metrics=("ethayarajh",), ethayarajh_words=cap, load_entry_points=False))
    trainer = Trainer(model=model, args=args, train_dataset=PaddedDataset(), callbacks=[cb, snaps])
    trainer.train()
    (logged,) = [r for r in trainer.state.log_history if "aniso/ethayarajh/layer_0/self_sim" in r]
    assert logged["step"] == 2
    measured = 2  # forwards: step 1 micro-batches 0, 1; step 2 micro-batch 0 <- measured
    ids, mask = inputs[measured]["input_ids"], inputs[measured]["attention_mask"]
    assert (mask == 0).any()  # padding is present and must be left out

    # the hooked block outputs are output_hidden_states of the same micro-batch and weights
    # (hidden_states[i + 1] is block i's output, except the last, which is after ln_f)
    replay = gpt2()
    replay.load_state_dict(snaps.states[1])
    with torch.no_grad():
        states = replay(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
    torch.testing.assert_close(states[1], outputs[0][measured], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(states[2], replay.transformer.ln_f(outputs[1][measured]), rtol=1e-5, atol=1e-6)

    ref_ids, counted = ref_positions(np.zeros(ids.shape), ids.numpy(), mask.numpy(), HF_V)
    occ = ref_occurrences(ref_ids, counted)
    chosen, beyond = ref_words(occ, cap)
    assert beyond and logged["aniso/ethayarajh/words"] == cap
    for i in range(2):
        ref = ref_layer(outputs[i][measured].double().numpy(), ref_ids, counted, cap)
        got = {k: logged[f"aniso/ethayarajh/layer_{i}/{k}"] for k in KEYS}
        assert_metrics(got, ref, f"layer {i}", rtol=1e-5, atol=1e-6)
    assert logged["aniso/ethayarajh/baseline_pair_share"] == pytest.approx(ref_pair_share(occ, cap), rel=1e-9)


# --- 2 gloo ranks -----------------------------------------------------------------------------
DIST_CAP = 4


def _dist_worker(rank: int, world: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.set_default_dtype(torch.float64)
    out = {}
    for mode in ("ddp", "fsdp2"):
        model = LM(seed=3)
        config = AnisoConfig(metrics=("ethayarajh",), ethayarajh_words=DIST_CAP, load_entry_points=False)
        plugins = AnisoPlugins(config)
        plugins.setup(ModelHandle(model, head="lm_head", input_embedding="embed", blocks="blocks"))
        seen = _block_outputs(model)
        if mode == "fsdp2":
            mesh = init_device_mesh("cpu", (world,))
            for block in model.blocks:
                fully_shard(block, mesh=mesh)
            fully_shard(model, mesh=mesh)
            wrapped = model
        else:
            wrapped = nn.parallel.DistributedDataParallel(model)
        ids, mask, targets = lm_batch(77 + rank, b=2 + rank)  # different sentences (and counts) per rank
        info = StepInfo(step=1, measure=True, input_ids=ids, attention_mask=mask)
        plugins.targets(targets, info)
        F.cross_entropy(wrapped(ids).reshape(-1, V), targets.reshape(-1), ignore_index=IGNORE).backward()
        plugins.step_end(StepInfo(step=1))
        out[mode] = {
            "metrics": plugins.measure(StepInfo(step=1, measure=True)),
            "blocks": [seen[i][0] for i in range(LAYERS)],
            "ids": ids,
            "mask": mask,
        }
    return out


@pytest.mark.slow
def test_two_ranks_equal_the_single_process_reference_over_the_union():
    results = run_distributed(_dist_worker)
    for mode in ("ddp", "fsdp2"):
        r0, r1 = results[0][mode], results[1][mode]
        assert r0["metrics"].keys() == r1["metrics"].keys()
        for name, value in r0["metrics"].items():
            assert value == r1["metrics"][name] or (math.isnan(value) and math.isnan(r1["metrics"][name])), name
        ids = torch.cat([r0["ids"], r1["ids"]]).numpy()
        mask = torch.cat([r0["mask"], r1["mask"]]).numpy()
        ref_ids, counted = ref_positions(np.zeros(ids.shape), ids, mask, V)
        occ = ref_occurrences(ref_ids, counted)
        chosen, beyond = ref_words(occ, DIST_CAP)
        assert beyond  # the cap binds: the baseline leaves out pairs beyond it
        # some chosen word occurs on both ranks (its sum crosses ranks)
        assert any({s < len(r0["ids"]) for s, _ in occ[w]} == {True, False} for w in chosen)
        metrics = r0["metrics"]
        assert metrics["aniso/ethayarajh/words"] == len(chosen)
        assert metrics["aniso/ethayarajh/baseline_pair_share"] == pytest.approx(ref_pair_share(occ, DIST_CAP), rel=1e-12)
        for i in range(LAYERS):
            hidden = torch.cat([r0["blocks"][i], r1["blocks"][i]]).numpy()
            got = {k: metrics[f"aniso/ethayarajh/layer_{i}/{k}"] for k in KEYS}
            assert_metrics(got, ref_layer(hidden, ref_ids, counted, DIST_CAP), f"{mode} layer {i}")
