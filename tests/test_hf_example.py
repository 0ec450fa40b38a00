"""examples/hf_train.py as a new user meets it (issue 43): the final table says which way each row
is better and puts the MLE baseline beside the run, and the run leaves no folder behind."""

from __future__ import annotations

import tempfile

import hf_train
from comparison import MLE_AT_DEFAULTS, TABLE, print_table


def test_the_table_has_a_direction_per_row_and_the_baseline_beside_the_run(capsys):
    run = {k: 2.0 * v for k, v in MLE_AT_DEFAULTS.items()}
    rows = print_table("agg", run, "eval_", MLE_AT_DEFAULTS, "MLE (stored)")
    out = capsys.readouterr().out.splitlines()
    assert len(rows) == len(TABLE) == len(MLE_AT_DEFAULTS)
    assert "this run" in out[2] and "MLE (stored)" in out[2]
    line = next(x for x in out if x.strip().startswith("I(W) of the head (raw"))
    assert line.split()[-3:] == ["↑", f"{2 * 0.6039:.4g}", "0.6039"]
    line = next(x for x in out if "mean cosine of the head's rows" in x)
    assert line.split()[-3:] == ["→0", f"{2 * 0.5622:.4g}", "0.5622"]
    assert out[-1].strip().startswith("↓ lower is better; ↑ higher is better")


def test_a_short_run_prints_the_hint_for_its_baseline_and_leaves_no_folder(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    hf_train.main(["--method", "agg", "--steps", "3", "--vocab-size", "256", "--batch-size", "4", "--block", "16"])
    out = capsys.readouterr().out
    assert "validation perplexity" in out and "MLE (stored)" not in out  # not the defaults: no stored baseline
    assert "the same command with --method mle" in out
    assert list(tmp_path.iterdir()) == []  # the Trainer's output folder is gone
