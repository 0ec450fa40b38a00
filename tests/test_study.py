"""The reproduction study's quick mode (examples/study.py --quick) through the real script: it
trains MLE, AGG and SimCTG through the real HF Trainer and writes every file, whose numbers are
consistent with the runs they summarize."""

from __future__ import annotations

import json
import statistics

FILES = ("runs.json", "study.md", "trajectories.png", "rare_isotropy.png", "groups.png", "tradeoff.png", "report/spectrum.png",
         "report/projection.png", "report/norm_frequency.png")


def test_quick_study_writes_every_file(tmp_path, run_example):
    out = tmp_path / "study"
    run_example("study.py", "--quick", "--output-dir", str(out))
    for name in FILES:
        assert (out / name).stat().st_size > 0, name
    runs = json.loads((out / "runs.json").read_text())
    assert [(r["method"], r["seed"]) for r in runs] == [("mle", 0), ("agg", 0), ("simctg", 0)]
    for r in runs:
        assert r["history"]["aniso/geometry/head/isotropy"], r["method"]  # a trajectory was logged
        assert 0.0 < r["final"]["aniso/geometry/head/isotropy"] <= 1.0
        assert 0.0 < r["final"]["aniso/bottleneck/lost_fraction"] < 1.0
    table = (out / "study.md").read_text()
    ppl = runs[1]["final"]["eval_aniso/eval/ppl"]  # one seed: the table shows the run's value
    assert f"| agg | 1 | {statistics.fmean([ppl]):.4g} |" in table
    from PIL import Image

    for name in FILES[2:]:
        with Image.open(out / name) as image:
            assert image.size[0] > 100, name
    report = json.loads((out / "report" / "report.json").read_text())
    assert [m["name"] for m in report["models"]] == ["mle", "agg"]
    sizes = report["models"][0]["text"]["group_sizes"]  # the projection's colours: every row in one group
    assert sum(sizes.values()) == 512 and min(sizes.values()) > 0

    # the same command again resumes: nothing is retrained, the runs are kept as they were
    again = run_example("study.py", "--quick", "--output-dir", str(out))
    assert "resuming: 3 of 3 runs" in again and "[1/3]" not in again
    assert json.loads((out / "runs.json").read_text()) == runs

    # a narrower command on the same directory keeps the other methods' runs in runs.json
    run_example("study.py", "--quick", "--methods", "mle", "--output-dir", str(out))
    assert json.loads((out / "runs.json").read_text()) == runs
