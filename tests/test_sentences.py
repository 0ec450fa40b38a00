"""Sentence embeddings and their post-processing: the report's ``sentences`` geometry of an
encoder's pooled vectors and ``aniso postprocess`` (the real CLI in a subprocess), against a
numpy mean pooling written out here and the whitening's defining property (identity
covariance on the fit sentences)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from aniso_plugins.offline import report as report_mod  # noqa: E402
from test_report import MAX_TOKENS, ref_mean_cosine, run_cli, zoo  # noqa: E402,F401  (zoo: the tiny models fixture)


def ref_embeddings(folder, lines: list[str], pooling: str = "mean") -> np.ndarray:
    """Each line alone through the encoder (no padding), pooled in numpy float64."""
    tok = transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)
    model = transformers.AutoModel.from_pretrained(folder, local_files_only=True).eval()
    out = []
    with torch.no_grad():
        for line in lines:
            enc = tok(line, truncation=True, max_length=64, return_tensors="pt")
            h = model(**enc).last_hidden_state[0].double().numpy()
            out.append(h[0] if pooling == "cls" else h.mean(0))
    return np.stack(out)


def _lines(zoo) -> list[str]:
    return [x.strip() for x in (zoo / "text.txt").read_text(encoding="utf-8").splitlines() if x.strip()]


def test_the_report_measures_an_encoders_sentence_embeddings_before_and_after(zoo, tmp_path):
    text = "\n".join(_lines(zoo)[:300])
    rep = report_mod.analyze([str(zoo / "mlm")], report_mod.TextOptions(text=text, max_tokens=2000), progress=False,
                             postprocess=["whitening"])
    s = rep.models[0]["sentences"]
    assert s["pooling"] == "mean" and s["sentences"] == 300
    x = ref_embeddings(zoo / "mlm", _lines(zoo)[:300])
    assert s["geometry"]["raw"]["mean_cosine"] == pytest.approx(ref_mean_cosine(x), rel=1e-4)
    assert s["geometry"]["postprocessed"]["whitening"]["isoscore"] == pytest.approx(1.0, abs=1e-6)
    md = rep.to_markdown()
    assert "## Sentence embeddings" in md and "### Sentence embeddings after whitening" in md


def test_a_text_on_one_line_keeps_the_token_report_and_skips_the_sentences_with_a_note(zoo, tmp_path):
    """A text dump without newlines is one sentence: the token-level report is written, the
    sentence embeddings are skipped with the reason in report.json, report.md and on stderr;
    `aniso postprocess`, which has nothing to fit without sentences, still refuses it."""
    (tmp_path / "one_line.txt").write_text(" ".join(_lines(zoo)), encoding="utf-8")
    out = tmp_path / "r"
    p = run_cli(zoo / "mlm", "--text-file", tmp_path / "one_line.txt", "--max-tokens", MAX_TOKENS, "--out", out, "--quiet",
                "--no-plots")
    assert p.returncode == 0, p.stderr
    (entry,) = json.loads((out / "report.json").read_text())["models"]
    assert entry["kind"] == "masked-lm" and entry["text"]["tokens"] > 0 and len(entry["text"]["hidden_mean_cosine"]) >= 2
    assert entry["matrices"]["embedding"]["raw"]["mean_cosine"] is not None and "suspected" in entry["under_trained"]
    reason = entry["sentences"]["skipped"]
    assert set(entry["sentences"]) == {"skipped"} and "1 non-empty line" in reason and "at least 2" in reason
    assert p.stderr.strip().splitlines() == [f"aniso report: warning: mlm: sentence embeddings skipped: {reason}"]
    md = (out / "report.md").read_text()
    assert "## Sentence embeddings" in md and reason in md
    p = subprocess.run([sys.executable, "-m", "aniso_plugins.offline.cli", "postprocess", str(zoo / "mlm"), "--text-file",
                        str(tmp_path / "one_line.txt"), "--transform", "whitening", "--out", str(tmp_path / "w")],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 2 and "1 non-empty line" in p.stderr and not (tmp_path / "w").exists(), p.stderr


def test_aniso_postprocess_fits_saves_and_the_saved_whitening_whitens(zoo, tmp_path):
    lines = _lines(zoo)[:200]
    (tmp_path / "s.txt").write_text("\n".join(lines), encoding="utf-8")
    out = tmp_path / "w"
    p = subprocess.run([sys.executable, "-m", "aniso_plugins.offline.cli", "postprocess", str(zoo / "mlm"), "--text-file",
                        str(tmp_path / "s.txt"), "--transform", "whitening", "--k", "8", "--out", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    summary = json.loads((out / "postprocess.json").read_text())
    assert (summary["sentences"], summary["dim"], summary["out_dim"], summary["pooling"]) == (200, 24, 8, "mean")
    assert summary["after"]["isoscore"] == pytest.approx(1.0, abs=1e-6) and summary["before"]["isoscore"] < 0.9
    from aniso_plugins.offline.postprocess import load_transform

    t = load_transform(out / "transform.safetensors")
    y = t.transform(torch.from_numpy(ref_embeddings(zoo / "mlm", lines))).numpy()
    np.testing.assert_allclose(np.cov(y, rowvar=False), np.eye(8), atol=1e-4)  # whitened: identity covariance


def test_sentence_transformers_pooling_and_bad_k(zoo, tmp_path):
    import shutil

    from aniso_plugins.offline.sentences import model_pooling

    folder = tmp_path / "st"
    shutil.copytree(zoo / "mlm", folder)
    (folder / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_cls_token": True}))  # v2–v5
    assert model_pooling(folder) == "cls" and model_pooling(zoo / "mlm") == "mean"
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode": "mean"}))  # v6
    assert model_pooling(folder) == "mean"
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode": "cls"}))
    (tmp_path / "s.txt").write_text("\n".join(_lines(zoo)[:50]), encoding="utf-8")
    base = [sys.executable, "-m", "aniso_plugins.offline.cli", "postprocess", str(folder), "--text-file", str(tmp_path / "s.txt")]
    p = subprocess.run(base + ["--transform", "centering", "--out", str(tmp_path / "c")], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert json.loads((tmp_path / "c" / "postprocess.json").read_text())["pooling"] == "cls"
    p = subprocess.run(base + ["--transform", "centering", "--k", "4", "--out", str(tmp_path / "d")], capture_output=True, text=True, timeout=300)
    assert p.returncode == 2 and "only whitening (directions kept) and all_but_the_top" in p.stderr and not (tmp_path / "d").exists()


def test_a_causal_lms_untied_head_is_centred_into_a_new_checkpoint_with_the_same_probabilities(zoo, tmp_path):
    out = tmp_path / "centred"
    base = [sys.executable, "-m", "aniso_plugins.offline.cli", "postprocess"]
    p = subprocess.run(base + [str(zoo / "llama"), "--transform", "centering", "--out", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    old = transformers.AutoModelForCausalLM.from_pretrained(zoo / "llama", local_files_only=True).eval()
    new = transformers.AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
    w_old, w_new = old.lm_head.weight.detach().double().numpy(), new.lm_head.weight.detach().double().numpy()
    np.testing.assert_allclose(w_new, w_old - w_old.mean(0), atol=1e-6)  # the rows centred
    assert np.abs(w_new.mean(0)).max() < 1e-6
    ids = torch.randint(0, w_old.shape[0], (3, 20), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        lp_old = torch.log_softmax(old(input_ids=ids).logits.double(), -1)
        lp_new = torch.log_softmax(new(input_ids=ids).logits.double(), -1)
    assert (lp_new - lp_old).abs().max() < 1e-4 and json.loads((out / "postprocess.json").read_text())["max_logprob_change"] < 1e-4
    assert (out / "tokenizer.json").exists()
    for args, message in (([str(zoo / "gpt2"), "--transform", "centering"], "tied to the input embedding"),
                          ([str(zoo / "llama"), "--transform", "whitening"], "only centering keeps")):
        p = subprocess.run(base + args + ["--out", str(tmp_path / "x")], capture_output=True, text=True, timeout=300)
        assert p.returncode == 2 and message in p.stderr, p.stderr


def test_a_sentence_transformers_model_gets_the_transform_as_its_last_module(zoo, tmp_path):
    st = pytest.importorskip("sentence_transformers")
    from sentence_transformers.sentence_transformer.modules import Pooling, Transformer

    word = Transformer(str(zoo / "mlm"), max_seq_length=64)
    word.tokenizer.pad_token = "<unk>"  # the zoo tokenizer has no pad token; sentence-transformers pads batches
    model = st.SentenceTransformer(modules=[word, Pooling(24, "mean")], device="cpu")
    model.save(str(tmp_path / "st"))
    lines = _lines(zoo)[:120]
    (tmp_path / "s.txt").write_text("\n".join(lines), encoding="utf-8")
    p = subprocess.run([sys.executable, "-m", "aniso_plugins.offline.cli", "postprocess", str(tmp_path / "st"), "--text-file",
                        str(tmp_path / "s.txt"), "--transform", "whitening", "--k", "6", "--out", str(tmp_path / "w")],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    folder = str(tmp_path / "w" / "sentence_transformer")
    whitened = st.SentenceTransformer(folder, device="cpu", trust_remote_code=True).encode(lines, convert_to_numpy=True)
    raw = model.encode(lines, convert_to_numpy=True)
    from aniso_plugins.offline.postprocess import load_transform

    t = load_transform(tmp_path / "w" / "transform.safetensors")
    np.testing.assert_allclose(whitened, t.transform(torch.from_numpy(raw)).numpy(), atol=1e-4)
    np.testing.assert_allclose(np.cov(whitened.astype(np.float64), rowvar=False), np.eye(6), atol=1e-3)
