"""`aniso report` on models trained with the low-rank head (``AnisoConfig(head="lowrank")``, issue
#53): the head is W = A·B of the saved ``lm_head.A`` (V×r) and ``lm_head.B`` (r×d), from every
format the report reads (an HF model folder, streamed and loaded; safetensors files; a Lightning
``.ckpt`` of a real ``lightning.Trainer`` run; DCP folders as torchtitan and accelerate's FSDP lay
them out), in both layouts (A and B only; A and B beside ``weight`` = A·B), and the report says
so. Every reported number is checked against a float64 numpy reference computed here from A @ B
(`test_report.ref_mean_cosine`). The ZeRO-3 run: tests/test_report_engine_checkpoints.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

transformers = pytest.importorskip("transformers")

from test_report import _text, _tokenizer, ref_mean_cosine  # noqa: E402

from aniso_plugins.methods.heads.lowrank import LowRankHead  # noqa: E402
from aniso_plugins.offline.errors import ReportError  # noqa: E402
from aniso_plugins.offline.sources import load_model  # noqa: E402

RANK = 4
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore"}
AB_NOTE = f"LM head: low-rank, W = A·B (rank {RANK}), from lm_head.A and lm_head.B"


def _cli(*args) -> tuple[subprocess.CompletedProcess, dict | None]:
    """``aniso report ARGS --no-plots --json`` in a subprocess (not --quiet: the notes on stderr)."""
    p = subprocess.run([sys.executable, "-m", "aniso_plugins.offline.cli", "report", *map(str, args), "--no-plots",
                        "--json"], capture_output=True, text=True, env=ENV, timeout=300)
    return p, (json.loads(p.stdout) if p.returncode == 0 else None)


def ref_product(a: torch.Tensor, b: torch.Tensor) -> np.ndarray:
    """The head W = A·B in float64, from the factors (numpy, not the package's product)."""
    return a.detach().double().numpy() @ b.detach().double().numpy()


def assert_head(entry: dict, w: np.ndarray) -> None:
    """A report.json matrix entry against the float64 reference `w`: raw and centred mean cosine,
    mean row norm, the top `RANK` singular values (the others are 0 up to round-off)."""
    assert entry["raw"]["mean_cosine"] == pytest.approx(ref_mean_cosine(w), rel=1e-6, abs=1e-9)
    assert entry["centered"]["mean_cosine"] == pytest.approx(ref_mean_cosine(w, center=True), rel=1e-6, abs=1e-9)
    assert entry["norm_mean"] == pytest.approx(float(np.linalg.norm(w, axis=1).mean()), rel=1e-6)
    s = np.linalg.svd(w, compute_uv=False)
    np.testing.assert_allclose(entry["spectrum"][:RANK], s[:RANK] / s[0], rtol=1e-5)


def _lowrank_llama(vocab: int) -> transformers.LlamaForCausalLM:
    """A tiny untied Llama whose head was replaced by `LowRankHead.from_linear` (rank 4), the rows
    of A sharing a direction (a head with a cone, so the mean cosine is far from 0)."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False, bos_token_id=0, eos_token_id=0))
    model.lm_head = LowRankHead.from_linear(model.lm_head, RANK, init="random", generator=torch.Generator().manual_seed(1))
    model.config.tie_word_embeddings = False
    with torch.no_grad():
        model.lm_head.A[:, 0] += 0.3
    return model


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """HF model folders (``save_pretrained`` with a tokenizer) of the low-rank model: ``ab`` (the
    factors only), ``ab_weight`` (and ``lm_head.weight`` = A·B), ``ab_wrong`` (and a weight that
    is not A·B), ``ab_bin`` (the factors in a ``pytorch_model.bin``: loaded, never streamed),
    ``headless`` (an untied model saved without its head); the text; the model."""
    root = tmp_path_factory.mktemp("lowrank_hf")
    text = _text()
    (root / "text.txt").write_text(text[:20_000], encoding="utf-8")
    tok = _tokenizer(text)
    model = _lowrank_llama(len(tok))
    a, b = model.lm_head.A.detach(), model.lm_head.B.detach()
    # the layouts built explicitly: the state dict of a LowRankHead may or may not hold `weight`
    factors = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    product = torch.from_numpy(ref_product(a, b)).float()
    wrong = product + 0.05 * torch.randn(product.shape, generator=torch.Generator().manual_seed(2))
    for name, extra in (("ab", {}), ("ab_weight", {"lm_head.weight": product}), ("ab_wrong", {"lm_head.weight": wrong})):
        model.save_pretrained(root / name, state_dict={**factors, **extra})
        tok.save_pretrained(root / name)
        keys = set(load_file(root / name / "model.safetensors"))
        assert {"lm_head.A", "lm_head.B"} <= keys and ("lm_head.weight" in keys) is bool(extra), keys
    (root / "ab_bin").mkdir()
    (root / "ab_bin" / "config.json").write_text((root / "ab" / "config.json").read_text())
    torch.save({k: v.contiguous() for k, v in factors.items()}, root / "ab_bin" / "pytorch_model.bin")
    plain = transformers.LlamaForCausalLM(model.config)
    plain.save_pretrained(root / "headless", state_dict={k: v for k, v in plain.state_dict().items()
                                                         if not k.startswith("lm_head.")})
    return root, model, a, b, wrong.double().numpy()


def test_an_hf_folder_streamed_reports_a_times_b_and_says_so(hf, tmp_path):
    root, model, a, b, _ = hf
    w = ref_product(a, b)
    out = tmp_path / "r"
    p, data = _cli(root / "ab", root / "ab_weight", "--out", out)
    assert p.returncode == 0, p.stderr
    only, beside = data["models"]
    for m in (only, beside):
        assert m["kind"] == "causal-lm" and m["tied"] is False and set(m["matrices"]) == {"embedding", "head"}
        assert_head(m["matrices"]["head"], w)
        e = model.model.embed_tokens.weight.detach().double().numpy()
        assert m["matrices"]["embedding"]["raw"]["mean_cosine"] == pytest.approx(ref_mean_cosine(e), rel=1e-6)
    assert only["notes"] == [AB_NOTE]
    (note,) = beside["notes"]
    assert note.startswith(f"LM head: low-rank (rank {RANK}): lm_head.weight is reported") and "equals A·B" in note
    md = (out / "report.md").read_text()
    assert f"> **ab**: {AB_NOTE}" in md and f"> **ab_weight**: {note}" in md
    assert f"aniso report: note: ab: {AB_NOTE}" in p.stderr.splitlines()
    assert "warning" not in p.stderr
    loaded = load_model(root / "ab")  # streamed: no model loaded, the product read in row blocks
    assert loaded.model is None and loaded.notes == [AB_NOTE]
    head = loaded.matrices["head"]
    assert head.shape == tuple(w.shape) and head.dtype == "float32"
    np.testing.assert_allclose(torch.cat([r for _, r in head.blocks(7)]).double().numpy(), w, rtol=1e-6, atol=1e-7)


def test_an_hf_folder_loaded_for_a_text_runs_it_through_a_times_b(hf, tmp_path):
    """With --text-file the model is loaded (transformers would initialise the missing
    lm_head.weight at random): its head is A·B, so are its logits and the reported head."""
    root, model, a, b, _ = hf
    w = ref_product(a, b)
    ids = torch.randint(0, a.shape[0], (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = model(ids).logits
    for name, need_model in (("ab", True), ("ab_weight", True), ("ab_bin", False)):
        loaded = load_model(root / name, need_model=need_model)
        assert loaded.model is not None and loaded.notes and "low-rank" in loaded.notes[0]
        np.testing.assert_allclose(loaded.model.lm_head.weight.detach().double().numpy(), w, rtol=1e-6, atol=1e-7)
        with torch.no_grad():
            torch.testing.assert_close(loaded.model(ids).logits, expected, rtol=1e-5, atol=1e-5)
    p, data = _cli(root / "ab", "--text-file", root / "text.txt", "--max-tokens", "400", "--out", tmp_path / "r")
    assert p.returncode == 0, p.stderr
    m = data["models"][0]
    assert m["text"]["tokens"] > 0 and m["notes"] and m["notes"][0].startswith(AB_NOTE)
    assert_head(m["matrices"]["head"], w)


def test_a_stored_weight_that_is_not_a_times_b_is_reported_with_a_warning(hf, tmp_path):
    root, _, a, b, wrong = hf
    p, data = _cli(root / "ab_wrong", "--out", tmp_path / "r")
    assert p.returncode == 0, p.stderr
    m = data["models"][0]
    head = m["matrices"]["head"]  # the stored weight, not A·B
    assert head["raw"]["mean_cosine"] == pytest.approx(ref_mean_cosine(wrong), rel=1e-6, abs=1e-9)
    assert head["raw"]["mean_cosine"] != pytest.approx(ref_mean_cosine(ref_product(a, b)), rel=1e-3)
    (note,) = m["notes"]
    assert "lm_head.weight is not A·B" in note and "the stored weight is reported" in note
    warnings = [line for line in p.stderr.splitlines() if "warning" in line]
    assert warnings == [f"aniso report: warning: ab_wrong: {note}"], p.stderr


def test_an_hf_folder_without_its_head_is_refused_not_initialised_at_random(hf, tmp_path):
    root = hf[0]
    for need_model in (False, True):
        with pytest.raises(ReportError, match=r"headless has no lm_head\.weight .*initiali[sz]e it at random"):
            load_model(root / "headless", need_model=need_model)
    p, _ = _cli(root / "headless", "--out", tmp_path / "r")
    assert p.returncode == 2 and "no lm_head.weight" in p.stderr and "Traceback" not in p.stderr


def test_a_safetensors_file_and_folder_report_a_times_b_not_the_factors(hf, tmp_path):
    root, model, a, b, _ = hf
    w = ref_product(a, b)
    e = model.model.embed_tokens.weight.detach()
    folder = tmp_path / "shards"  # a folder of safetensors files, A and B in different files
    folder.mkdir()
    save_file({"model.embed_tokens.weight": e.contiguous(), "lm_head.A": a.contiguous()}, folder / "part1.safetensors")
    save_file({"lm_head.B": b.contiguous()}, folder / "part2.safetensors")
    single = tmp_path / "weights.safetensors"
    save_file({"model.embed_tokens.weight": e.contiguous(), "lm_head.A": a.contiguous(), "lm_head.B": b.contiguous()},
              single)
    p, data = _cli(single, folder, "--out", tmp_path / "r")
    assert p.returncode == 0, p.stderr
    for m in data["models"]:
        assert m["kind"] == "safetensors"
        assert set(m["matrices"]) == {"model.embed_tokens.weight", "lm_head.weight"}  # not lm_head.A, lm_head.B
        assert_head(m["matrices"]["lm_head.weight"], w)
        assert m["notes"] == [AB_NOTE]
    explicit = load_model(single, tensor=["lm_head.A"])  # a factor named is that factor
    assert set(explicit.matrices) == {"lm_head.A"} and explicit.notes == []
    named = load_model(single, tensor=["lm_head.weight"])  # the head's name: the product
    assert set(named.matrices) == {"lm_head.weight"} and named.notes == [AB_NOTE]


def _rewritten(ckpt: Path, out: Path, weight: bool) -> Path:
    """`ckpt` with its state dict's ``model.lm_head.weight`` = A·B added (`weight`) or removed."""
    state = torch.load(ckpt, map_location="cpu", weights_only=True)
    sd = state["state_dict"]
    sd.pop("model.lm_head.weight", None)
    if weight:
        sd["model.lm_head.weight"] = (sd["model.lm_head.A"].double() @ sd["model.lm_head.B"].double()).float()
    torch.save(state, out)
    return out


def test_a_lightning_checkpoint_of_a_low_rank_run_reports_a_times_b(tmp_path):
    """A real lightning.Trainer run with the low-rank head (AnisoCallback, head="lowrank"): its
    ModelCheckpoint .ckpt, in both layouts; the head found by name and named with --head."""
    import lightning.pytorch as pl
    from lightning_utils import LitLM, loader

    from aniso_plugins import AnisoConfig
    from aniso_plugins.integrations.lightning import AnisoCallback

    cb = AnisoCallback(AnisoConfig(head="lowrank", lowrank_rank=RANK, metrics=(), load_entry_points=False),
                       head="model.lm_head", input_embedding="model.embed", blocks="model.blocks", targets="causal")
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=str(tmp_path), num_sanity_val_steps=0,
                         callbacks=[cb])
    module = LitLM(tied=False)
    trainer.fit(module, loader())
    assert isinstance(module.model.lm_head, LowRankHead)
    (ckpt,) = (tmp_path / "checkpoints").glob("*.ckpt")
    w = ref_product(module.model.lm_head.A, module.model.lm_head.B)
    only = _rewritten(ckpt, tmp_path / "ab.ckpt", weight=False)
    beside = _rewritten(ckpt, tmp_path / "ab_weight.ckpt", weight=True)
    p, data = _cli(only, beside, "--out", tmp_path / "r")
    assert p.returncode == 0, p.stderr
    for m in data["models"]:
        assert m["kind"] == "lightning" and m["tied"] is False and set(m["matrices"]) == {"embedding", "head"}
        assert_head(m["matrices"]["head"], w)
    note = "LM head: low-rank, W = A·B (rank 4), from model.lm_head.A and model.lm_head.B"
    assert data["models"][0]["notes"] == [note]
    assert "model.lm_head.weight is reported" in data["models"][1]["notes"][0]
    for head in ("model.lm_head", "model.lm_head.weight"):  # --head: the module, or its weight's name
        loaded = load_model(only, head=head)
        assert loaded.notes == [note]
        np.testing.assert_allclose(loaded.matrices["head"].read(0, w.shape[0]).double().numpy(), w, rtol=1e-6, atol=1e-7)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")  # one process, on purpose
def test_dcp_folders_of_low_rank_runs_report_a_times_b(tmp_path):
    """A DCP folder written by torch.distributed.checkpoint.save in one process: torchtitan's
    layout (``step-N``, the head ``output``) and accelerate's FSDP one (``checkpoint-N/
    pytorch_model_fsdp_0``, the model under ``model.``), each with and without the weight."""
    import torch.distributed.checkpoint as dcp

    torch.manual_seed(0)
    vocab, d = 48, 16
    emb, a, b = torch.randn(vocab, d), torch.randn(vocab, RANK) + 0.3, torch.randn(RANK, d)
    w = ref_product(a, b)
    product = torch.from_numpy(w).float()
    layouts = {
        "titan": ("dump/checkpoint/step-3", "", "tok_embeddings.weight", "output"),
        "accelerate": ("run/checkpoint-4/pytorch_model_fsdp_0", "model.", "model.embed_tokens.weight", "lm_head"),
    }
    cases, given = [], []
    for name, (folder, prefix, emb_key, head) in layouts.items():
        for weight in (False, True):
            state = {prefix + emb_key: emb.clone(), f"{prefix}{head}.A": a.clone(), f"{prefix}{head}.B": b.clone()}
            if weight:
                state[f"{prefix}{head}.weight"] = product.clone()
            where = tmp_path / f"{name}_{weight}" / folder
            dcp.save(state, checkpoint_id=str(where), no_dist=True)
            cases.append((head, weight))
            given.append(where.parent)  # dump/checkpoint (its newest step-N), run/checkpoint-4
    p, data = _cli(*given, "--out", tmp_path / "r")
    assert p.returncode == 0, p.stderr
    for (head, weight), m in zip(cases, data["models"], strict=True):
        assert m["kind"] == "dcp" and m["tied"] is False and set(m["matrices"]) == {"embedding", "head"}, m
        assert_head(m["matrices"]["head"], w)
        assert m["matrices"]["embedding"]["raw"]["mean_cosine"] == pytest.approx(
            ref_mean_cosine(emb.double().numpy()), rel=1e-6, abs=1e-9)
        (note,) = m["notes"]
        if weight:
            assert note.startswith(f"LM head: low-rank (rank {RANK}): {head}.weight is reported"), note
        else:
            assert note == f"LM head: low-rank, W = A·B (rank {RANK}), from {head}.A and {head}.B"


def test_factors_whose_shapes_do_not_chain_are_refused(tmp_path):
    """A (V×r) and B (r×d) with r < d: anything else next to where the head should be is no
    low-rank head, and with no weight there the report says so rather than guessing."""
    torch.manual_seed(0)
    for a, b in ((torch.randn(32, 4), torch.randn(5, 16)), (torch.randn(32, 16), torch.randn(16, 16))):
        f = tmp_path / f"bad{a.shape[1]}{b.shape[0]}.safetensors"
        save_file({"embed_tokens.weight": torch.randn(32, 16), "lm_head.A": a, "lm_head.B": b}, f)
        with pytest.raises(ReportError, match=r"lm_head\.A .* and lm_head\.B .* are not the factors of a low-rank head"):
            load_model(f)


def test_an_in_memory_model_with_a_low_rank_head_is_reported_as_a_times_b(hf):
    """`analyze` / `write_report` of the model itself (e.g. at the end of training): the same product
    and note as from its files."""
    from aniso_plugins.offline.report import analyze

    _, model, a, b, _ = hf
    m = analyze([model], progress=False).models[0]
    assert m["notes"] == [AB_NOTE] and m["tied"] is False
    assert_head(m["matrices"]["head"], ref_product(a, b))
