"""`aniso report` for a new user (issue #43): the report without matplotlib, the under-trained
section's one threshold in text, table and plot, pictures titled and shown in report.md, the
messages for a text file and a training output folder given as the model, the exit code after
the report is committed, the help, and a model with its own vocabulary as docs/report.md says."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("matplotlib")

from test_report import PNG, _text, _tokenizer  # noqa: E402
from test_report_under_trained import _planted_checkpoint  # noqa: E402

from aniso_plugins.offline import cli, render  # noqa: E402
from aniso_plugins.offline import output as output_mod  # noqa: E402
from aniso_plugins.offline import report as report_mod  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore"}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """``tok``: a tiny GPT-2 with padding rows beyond its tokenizer (reference tokens, so a
    threshold); ``bare``: a tiny GPT-2 saved without a tokenizer (the norm ranking)."""
    root = tmp_path_factory.mktemp("models")
    _planted_checkpoint(root / "tok", _tokenizer(_text()), [17, 101, 202])
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=120, n_embd=16, n_layer=1, n_head=2, n_positions=32, bos_token_id=0, eos_token_id=0,
    )).save_pretrained(root / "bare")
    return root


def _cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "aniso_plugins.offline.cli", *map(str, args)],
                          capture_output=True, text=True, env=env or ENV, cwd=ROOT, timeout=300)


def test_without_matplotlib_the_report_is_written_with_one_warning(models, tmp_path):
    """matplotlib unimportable (a package on PYTHONPATH that raises ImportError): exit 0,
    report.json and report.md, no picture, one warning naming the install and --no-plots."""
    blocker = tmp_path / "block" / "matplotlib"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ImportError(\"No module named 'matplotlib' (blocked by the test)\")\n")
    env = {**ENV, "PYTHONPATH": os.pathsep.join([str(blocker.parent), ENV.get("PYTHONPATH", "")])}
    out = tmp_path / "o"
    p = _cli("report", models / "bare", "--out", out, "--quiet", env=env)
    assert p.returncode == 0, p.stderr
    assert sorted(f.name for f in out.iterdir()) == ["report.json", "report.md"]
    assert json.loads((out / "report.json").read_text())["models"][0]["name"] == "bare"
    md = (out / "report.md").read_text()
    assert "## Geometry" in md and "## Plots" not in md and ".png" not in md
    warnings = [line for line in p.stderr.splitlines() if "warning" in line]
    assert len(warnings) == 1, p.stderr
    assert warnings[0].startswith("aniso report: warning: matplotlib is not installed")
    assert 'pip install -e ".[report]"' in warnings[0] and "--no-plots" in warnings[0]
    assert "PyPI" not in p.stderr
    quiet = _cli("report", models / "bare", "--out", out, "--quiet", "--no-plots", env=env)
    assert quiet.returncode == 0 and "warning" not in quiet.stderr, quiet.stderr


def _written(model: Path, out: Path, *extra: str) -> tuple[dict, str]:
    assert cli.main(["report", str(model), "--out", str(out), "--quiet", *extra]) == 0
    return json.loads((out / "report.json").read_text())["models"][0], (out / "report.md").read_text()


def _section(md: str) -> str:
    return md[md.index("## Under-trained tokens"):md.index("## Plots")]


def test_under_trained_text_table_and_plot_state_the_same_threshold(models, tmp_path):
    """With reference tokens (padding rows beyond the tokenizer): 'Suspected (score ≥ 0.5): N'
    with N the scores ≥ 0.5 outside R, the table's score column names 0.5, the plot's dashed
    line stands at 0.5; every token is a decoded string."""
    m, md = _written(models / "tok", tmp_path / "o")
    u = m["under_trained"]
    section = _section(md)
    assert u["suspected"] >= 3 and f"Suspected (score ≥ 0.5): {u['suspected']:,}" in section and u["threshold"] == 0.5
    assert "| id | token | category | score (suspected ≥ 0.5) | input norm |" in section
    assert "None" not in section
    tok = transformers.AutoTokenizer.from_pretrained(models / "tok", local_files_only=True)
    first = u["candidates"][0]
    assert f"| {first['id']} | `{tok.convert_ids_to_tokens(first['id'])}` |" in section
    rep = report_mod.analyze([str(models / "tok")], progress=False)
    fig = render._plot_under_trained(render._pyplot(), [rep.models[0]])
    ax = fig.axes[0]
    lines = [ln for ln in ax.get_lines() if ln.get_linestyle() == "--"]
    assert len(lines) == 1 and list(lines[0].get_xdata()) == [0.5, 0.5]
    assert "threshold 0.5" in lines[0].get_label() and "cosine" in ax.get_xlabel()
    assert fig._suptitle.get_text() == render.PLOTS["under_trained.png"][0]
    render._pyplot().close("all")


def test_under_trained_without_reference_or_tokenizer_says_there_is_no_threshold(models, tmp_path):
    """No tokenizer: the norm ranking; no 'None' token, no 'Suspected (score ≥ 0.5)' above the
    norm z-scores, the table and the plot say there is no threshold."""
    m, md = _written(models / "bare", tmp_path / "o")
    u = m["under_trained"]
    section = _section(md)
    assert u["suspected"] is None and max(c["score"] for c in u["candidates"]) > 1  # z-scores, not cosines
    assert u["threshold"] is None  # report.json agrees: the norm ranking has none
    assert "None" not in section and "Suspected" not in section and "≥ 0.5" not in section
    assert "No threshold, nothing suspected" in section and "No tokenizer: each token is given by its id." in section
    assert "| id | category | norm z-score (no threshold) | input norm |" in section
    assert f"| {u['candidates'][0]['id']} | unknown | {render._fmt(u['candidates'][0]['score'])} |" in section
    rep = report_mod.analyze([str(models / "bare")], progress=False)
    fig = render._plot_under_trained(render._pyplot(), [rep.models[0]])
    ax = fig.axes[0]
    assert ax.get_lines() == [] and "no threshold" in ax.get_xlabel()
    render._pyplot().close("all")


def test_every_picture_is_titled_and_shown_in_report_md_with_its_axes(models, tmp_path):
    out, text = tmp_path / "o", tmp_path / "text.txt"
    text.write_text(_text()[:20_000], encoding="utf-8")
    _, md = _written(models / "tok", out, "--text-file", str(text), "--max-tokens", "400")
    pngs = sorted(f.name for f in out.iterdir() if f.suffix == ".png")
    assert pngs == sorted(["spectrum.png", "cosines.png", "projection.png", "layers.png", "norm_frequency.png",
                           "under_trained.png"])
    plots = md[md.index("## Plots"):]
    for name in pngs:
        title, axes = render.PLOTS[name]
        assert (out / name).read_bytes().startswith(PNG)
        assert f"### {title}\n\n![{title}]({name})\n\n{axes}\n" in plots, name
    assert re.findall(r"!\[[^\]]*\]\(([^)]+)\)", md) == [n for n in render.PLOTS if n in pngs]  # relative, in order
    assert "⟨w, u_1⟩" in render.PLOTS["projection.png"][1] and "singular" in render.PLOTS["projection.png"][1]
    rep = report_mod.analyze([str(models / "tok")], progress=False)
    plt = render._pyplot()
    items = [(m, k, g) for m in rep.models for k, g in m["matrices"].items()]
    fig = render._plot_projection(plt, items)
    assert fig._suptitle.get_text() == render.PLOTS["projection.png"][0]
    assert "singular direction" in fig.axes[0].get_xlabel() and "singular direction" in fig.axes[0].get_ylabel()
    fig = render._plot_spectrum(plt, render._columns(rep))
    assert fig.axes[0].get_title() == render.PLOTS["spectrum.png"][0]
    plt.close("all")


def test_a_text_file_or_a_training_output_folder_as_the_model_says_what_to_give(tmp_path, capsys):
    notes = tmp_path / "notes.txt"
    notes.write_text("these are my notes about the run, not a model\n" * 20)
    run = tmp_path / "run"
    for step in (500, 1000, 20):
        (run / f"checkpoint-{step}").mkdir(parents=True)
    (run / "trainer_state.json").write_text("{}")
    configured = tmp_path / "configured"  # the Trainer's config.json saved at the top, no weights
    (configured / "checkpoint-3").mkdir(parents=True)
    (configured / "config.json").write_text("{}")
    listing = "it holds the checkpoints checkpoint-20, checkpoint-500, checkpoint-1000; report one of them, e.g. the latest"
    for model, expected in (
        (notes, f"{notes} is not a model: expected a Hugging Face model directory (config.json and weights"),
        (run, f"{run} is a training output folder, not a model directory: {listing}: aniso report {run / 'checkpoint-1000'}"),
        (configured, f"it holds the checkpoints checkpoint-3; report one of them, e.g. the latest: aniso report "
                     f"{configured / 'checkpoint-3'}"),
    ):
        assert cli.main(["report", str(model), "--out", str(tmp_path / "o"), "--quiet"]) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("aniso report: error: ") and expected in lines[0], lines
        assert "cannot read safetensors" not in lines[0] and "header" not in lines[0]


def _sigint_after_first(monkeypatch, module, name, when=lambda *a: True):
    """Patch ``module.name`` to run, then deliver a SIGINT, on its first call ``when(*args)``."""
    real, calls = getattr(module, name), []

    def patched(*a, **k):
        result = real(*a, **k)
        if when(*a):
            calls.append(a)
            if len(calls) == 1:
                signal.raise_signal(signal.SIGINT)
        return result

    monkeypatch.setattr(module, name, patched)
    return calls


def test_a_ctrl_c_in_the_rename_is_held_and_one_after_the_commit_exits_0(models, tmp_path, monkeypatch, capsys):
    """The exit code says what --out holds: a SIGINT between the two renames of the commit
    waits for the second (the new report is there, nothing hidden left over, exit 0); one while
    --json prints, after the commit, exits 0 too; one before it still exits 130."""
    out = tmp_path / "o"
    assert cli.main(["report", str(models / "bare"), "--out", str(out), "--quiet", "--no-plots"]) == 0
    capsys.readouterr()
    calls = _sigint_after_first(monkeypatch, output_mod.os, "replace",  # the earlier report moved aside, then Ctrl-C
                                when=lambda src, dst: Path(src).parent == tmp_path)
    assert cli.main(["report", str(models / "tok"), "--out", str(out), "--quiet", "--no-plots"]) == 0
    monkeypatch.undo()
    assert len(calls) == 2 and json.loads((out / "report.json").read_text())["models"][0]["name"] == "tok"
    assert [p.name for p in tmp_path.iterdir()] == ["o"]  # no .o.old-* / .o.tmp-* folder
    assert capsys.readouterr().err.strip().splitlines() == [
        f"aniso report: interrupted after {out} was written in full; it holds the new output"]
    _sigint_after_first(monkeypatch, report_mod.Report, "to_json")  # inside the write: before the commit
    assert cli.main(["report", str(models / "bare"), "--out", str(out), "--quiet", "--no-plots"]) == 130
    monkeypatch.undo()
    assert json.loads((out / "report.json").read_text())["models"][0]["name"] == "tok"  # the earlier one, kept
    capsys.readouterr()
    calls = []
    real = report_mod.Report.to_json

    def second_call_interrupted(self, *a, **k):  # the --json print, after the commit
        calls.append(1)
        if len(calls) == 2:
            signal.raise_signal(signal.SIGINT)
        return real(self, *a, **k)

    monkeypatch.setattr(report_mod.Report, "to_json", second_call_interrupted)
    assert cli.main(["report", str(models / "bare"), "--out", str(out), "--quiet", "--no-plots", "--json"]) == 0
    assert json.loads((out / "report.json").read_text())["models"][0]["name"] == "bare"
    assert "interrupted after" in capsys.readouterr().err


CTRL_C_AT = '''"""Run `aniso report` as the console script does, sys.exit(main()), with the user's Ctrl-C
(signal.raise_signal(SIGINT)) delivered at the moment named by the first argument."""
import atexit
import builtins
import signal
import sys
from pathlib import Path

from aniso_plugins.offline import cli, commands, output
from aniso_plugins.offline.report import Report

moment = sys.argv.pop(1)
out = Path(sys.argv[sys.argv.index("--out") + 1])


def ctrl_c():
    signal.raise_signal(signal.SIGINT)


def patch_after(owner, name, when):
    real = getattr(owner, name)

    def patched(*args, **kwargs):
        result = real(*args, **kwargs)
        if when(*args):
            ctrl_c()
        return result

    setattr(owner, name, patched)


class Watchers(list):  # the watch_commits lists: emptied as main leaves its with-blocks
    def remove(self, item):
        super().remove(item)
        ctrl_c()


if moment == "writing":  # report.json written into the temporary folder: before the commit
    patch_after(Report, "to_json", lambda *a: True)
elif moment == "last_file":  # the rename that puts the finished folder in place
    patch_after(output.os, "replace", lambda src, dst: Path(dst) == out)
elif moment == "last_line":  # the command's last line printed
    commands.print = builtins.print
    patch_after(commands, "print", lambda *a: str(a[0]).startswith("aniso report: wrote"))
elif moment == "leaving_main":  # the command returned, main leaving its with-blocks
    output._WATCHERS = Watchers(output._WATCHERS)
elif moment == "at_exit":  # the interpreter exiting
    atexit.register(ctrl_c)
code = cli.main()
if moment == "after_main":  # main returned, sys.exit not called yet
    ctrl_c()
sys.exit(code)
'''
"""A wrapper run by the CLI test below: ``python ctrl_c_at.py MOMENT report ...``."""


@pytest.mark.parametrize("moment", ["writing", "last_file", "last_line", "leaving_main", "after_main", "at_exit"])
def test_a_ctrl_c_once_the_report_is_committed_exits_0_in_the_cli_process(models, tmp_path, moment):
    """Issue #53: the CLI in a process of its own, run as the console script runs it, a SIGINT
    at a given moment: while the files are written, 130 and no report; from the rename of the
    finished folder on (the last file landing, the last line printed, main leaving, after main,
    at exit) 0 and the report whole. Before, a Ctrl-C once main had returned ended the process
    by the signal (-2), one while main left its with-blocks too, and one at exit printed a
    KeyboardInterrupt."""
    script = tmp_path / "ctrl_c_at.py"
    script.write_text(CTRL_C_AT)
    out = tmp_path / "o"
    p = subprocess.run([sys.executable, str(script), moment, "report", str(models / "bare"), "--out", str(out),
                        "--no-plots", "--json"], capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=300)
    assert "Traceback" not in p.stderr and "KeyboardInterrupt" not in p.stderr, p.stderr
    if moment == "writing":
        assert p.returncode == 130, (p.returncode, p.stderr)
        assert p.stderr.strip().splitlines()[-1] == "aniso report: interrupted" and p.stdout == ""
        assert [f.name for f in tmp_path.iterdir()] == [script.name]  # no report, no temporary folder
        return
    assert p.returncode == 0, (p.returncode, p.stderr)
    assert sorted(f.name for f in out.iterdir()) == ["report.json", "report.md"]
    written = json.loads((out / "report.json").read_text())
    assert written["models"][0]["name"] == "bare" and "## Geometry" in (out / "report.md").read_text()
    assert sorted(f.name for f in tmp_path.iterdir()) == sorted([script.name, "o"])
    if moment == "last_file":  # the command stops there: what it had not printed yet is cut short
        assert p.stderr.strip().splitlines()[-1] == (f"aniso report: interrupted after {out} was written in full; "
                                                     "it holds the new output")
    else:  # the whole output: the JSON on stdout, the last line on stderr
        assert json.loads(p.stdout) == written
        assert f"aniso report: wrote 2 files to {out}" in p.stderr.splitlines()


def test_help_shows_two_examples_and_no_command_prints_it(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--help"])
    assert e.value.code == 0
    help_text = capsys.readouterr().out
    examples = [line.strip() for line in help_text.splitlines() if line.strip().startswith("aniso report ")]
    assert len(examples) == 2 and "examples:" in help_text, help_text
    assert cli.main([]) == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: aniso") and "examples:" in err and all(x in err for x in examples)
    assert err.strip().splitlines()[-1] == "aniso: error: a command is required (report or postprocess)"
    p = _cli()
    assert p.returncode == 2 and "examples:" in p.stderr and "report" in p.stderr and p.stdout == ""


def _doc_blocks(language: str) -> str:
    """The ```language block of docs/report.md's "A model with its own vocabulary"."""
    doc = (ROOT / "docs" / "report.md").read_text()
    section = doc[doc.index("## A model with its own vocabulary"):]
    section = section[:section.index("\n## ")]
    return re.search(rf"```{language}\n(.*?)```", section, re.S).group(1)


def test_the_documented_own_vocabulary_tokenizer_makes_text_file_work(tmp_path, monkeypatch):
    """docs/report.md's lines, run as written: a word-level tokenizer trained on train.txt, saved
    beside the model; then its `aniso report ... --text-file valid.txt` command."""
    text = _text()
    monkeypatch.chdir(tmp_path)
    Path("train.txt").write_text(text[:60_000], encoding="utf-8")
    Path("valid.txt").write_text(text[60_000:70_000], encoding="utf-8")
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=400, n_embd=16, n_layer=1, n_head=2, n_positions=64, bos_token_id=0, eos_token_id=0))
    exec(_doc_blocks("python"), {"model": model})  # noqa: S102 - the documentation's own code
    words = shlex.split(_doc_blocks("bash").strip())
    assert words[:2] == ["aniso", "report"]
    env = {**ENV, "PYTHONPATH": os.pathsep.join([str(ROOT), ENV.get("PYTHONPATH", "")])}
    p = subprocess.run([sys.executable, "-m", "aniso_plugins.offline.cli", *words[1:], "--quiet", "--no-plots"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr
    m = json.loads(Path("runs/mine_report/report.json").read_text())["models"][0]
    tok = transformers.AutoTokenizer.from_pretrained("runs/mine", local_files_only=True)
    assert len(tok) == 400 and m["kind"] == "causal-lm"
    ids = tok(Path("valid.txt").read_text(), add_special_tokens=False)["input_ids"]
    assert m["text"]["tokens"] > 1000 and m["text"]["distinct_tokens"] <= len(set(ids))
    assert m["text"]["eval"]["ppl"] > 1
    vocab = tok.get_vocab()
    assert all(c["token"] in vocab for c in m["under_trained"]["candidates"])
