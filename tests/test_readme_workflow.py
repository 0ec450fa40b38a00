"""The README's "Look at a checkpoint" workflow, literally: train MLE and AGG with
examples/hf_train.py --output-dir, then `aniso report` on both folders with the saved
validation text (the real scripts and the real CLI in subprocesses)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["--steps", "6", "--vocab-size", "512", "--block", "32", "--batch-size", "8", "--d-model", "32"]


@pytest.mark.slow
def test_train_then_report_as_the_readme_says(tmp_path):
    runs = tmp_path / "runs"
    for method in ("mle", "agg"):
        proc = subprocess.run([sys.executable, "examples/hf_train.py", "--method", method, "--output-dir",
                               str(runs / method), *SMALL], cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert {"config.json", "model.safetensors", "tokenizer.json", "valid.txt"} <= set(os.listdir(runs / method))
    out = tmp_path / "report"
    proc = subprocess.run(
        [sys.executable, "-m", "aniso_plugins.offline.cli", "report", str(runs / "mle"), str(runs / "agg"),
         "--text-file", str(runs / "agg" / "valid.txt"), "--out", str(out), "--quiet", "--max-tokens", "2000"],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert [m["name"] for m in report["models"]] == ["mle", "agg"]
    for model in report["models"]:
        assert model["kind"] == "causal-lm" and model["text"]["eval"]["ppl"] > 1
    # the saved tokenizer gives the training ids: no validation word the vocabulary knows becomes <unk>
    from corpus import hf_tokenizer, load_text, tokenize

    ids, vocab = tokenize(load_text(None), 512)
    valid = (runs / "agg" / "valid.txt").read_text(encoding="utf-8")
    assert hf_tokenizer(vocab)(valid, add_special_tokens=False)["input_ids"] == ids[int(len(ids) * 0.9):].tolist()
