"""The machine-translation example's quick mode (examples/translation.py --quick) through the real
script: a tiny MarianMT trained with the real Seq2SeqTrainer and one AnisoCallback, MLE and AGG,
BLEU from ``trainer.predict`` with generation; results.json / results.md written, and a second
run on the same folder resumes instead of training again."""

from __future__ import annotations

import json
import math
import time

import pytest

pytest.importorskip("transformers")
pytest.importorskip("sacrebleu")

RUN_KEYS = ("bleu", "eval_aniso/eval/ppl", "eval_aniso/eval/ppl_rare", "eval_aniso/eval/uniq",
            "aniso/geometry/head/isotropy", "aniso/geometry/head/mean_cosine", "aniso/frequency/rare/isotropy")  # fmt: skip


def test_language_is_deterministic_and_follows_its_rules():
    from translation import CLASSES, EOS, SPECIALS, Language, Pairs, collate

    a, b = Language(300, 1.1, seed=7), Language(300, 1.1, seed=7)
    assert a.pairs(50, 1) == b.pairs(50, 1)
    assert a.pairs(50, 1) != Language(300, 1.1, seed=8).pairs(50, 1)
    for source, target in a.pairs(200, 1):
        assert 5 <= len(source) <= 20 and min(source) >= len(SPECIALS) and max(source) < a.vocab_size
        verbs = sum(CLASSES[a.word_class[w]] == "verb" for w in source)
        assert len(target) == len(source) + verbs  # every verb also emits its particle
        assert sorted(target) == sorted([int(a.translation[w]) for w in source] + [int(a.particles[w % 3]) for w in source
                                         if CLASSES[a.word_class[w]] == "verb"])  # fmt: skip
    # the rules on one hand-made sentence: adjective+noun swap, the first verb goes last with its particle
    adj, noun, verb, other = (next(w for w in range(3, a.vocab_size) if CLASSES[a.word_class[w]] == c)
                              for c in ("adj", "noun", "verb", "other"))  # fmt: skip
    t = [int(x) for x in a.translation]
    assert a.translate([other, verb, adj, noun]) == [t[other], t[noun], t[adj], t[verb], int(a.particles[verb % 3])]
    batch = collate(list(Pairs(a.pairs(3, 1))))
    assert batch["input_ids"].shape == batch["attention_mask"].shape
    assert batch["input_ids"][batch["attention_mask"] == 0].eq(0).all()  # padded with <pad>
    assert int((batch["labels"] == EOS).sum()) == 3 and int((batch["labels"] == 0).sum()) == 0  # labels with -100
    # the decoder inputs are the model's own shift of the labels (the Trainer keeps labels from the model under
    # label smoothing, so the batch must carry them)
    from transformers.models.marian.modeling_marian import shift_tokens_right

    assert batch["decoder_input_ids"].equal(shift_tokens_right(batch["labels"], 0, 2))


def test_label_smoothing_and_agg_options_reach_the_trainer(tmp_path, run_example):
    """--label-smoothing (both arms) and the agg arm's --alpha / --alpha-tokens / --window: recorded in the
    run's settings and in effect (the label smoother raises the Trainer's loss above the model's NLL; an alpha
    beyond every appearance makes the whole vocabulary rare)."""
    out = tmp_path / "mt"
    common = ("--quick", "--seeds", "0", "--output-dir", str(out), "--label-smoothing", "0.1")
    run_example("translation.py", *common, "--methods", "mle,agg", "--alpha-tokens", "65536", "--alpha", "1e9", "--window", "7")
    runs = {r["method"]: r for r in json.loads((out / "results.json").read_text())}
    for r in runs.values():
        assert r["settings"]["label_smoothing"] == 0.1
        assert {k: r["settings"][k] for k in ("alpha", "alpha_tokens", "window")} == {"alpha": 1e9, "alpha_tokens": 65536, "window": 7}
        f = r["final"]
        # smoothed loss (1 - e) NLL + e mean_k(-log p_k) > NLL = log(ppl), the unsmoothed eval metric
        assert f["eval_loss"] > math.log(f["eval_aniso/eval/ppl"]) + 0.05
    assert runs["agg"]["final"]["aniso/agg/rare_vocab_fraction"] == 1.0
    assert "aniso/agg/rare_vocab_fraction" not in runs["mle"]["final"]
    assert "label_smoothing 0.1" in (out / "results.md").read_text().splitlines()[0]


def test_quick_translation_runs_both_methods_and_resumes(tmp_path, run_example):
    out = tmp_path / "mt"
    args = ("--quick", "--methods", "mle,agg", "--seeds", "0", "--output-dir", str(out))
    start = time.perf_counter()
    stdout = run_example("translation.py", *args)
    first = time.perf_counter() - start
    runs = json.loads((out / "results.json").read_text())
    assert [(r["method"], r["seed"]) for r in runs] == [("mle", 0), ("agg", 0)]
    vocab = runs[0]["settings"]["words"] + 3
    for r in runs:
        f = r["final"]
        for key in RUN_KEYS:
            assert key in f and math.isfinite(f[key]), (r["method"], key)
        assert 0.0 <= f["bleu"] <= 100.0
        assert 0.0 < f["aniso/geometry/head/isotropy"] <= 1.0 and 0.0 < f["aniso/frequency/rare/isotropy"] <= 1.0
        assert -1.0 <= f["aniso/geometry/head/mean_cosine"] <= 1.0
        assert 1 <= f["eval_aniso/eval/uniq"] <= vocab and f["eval_aniso/eval/uniq"] == int(f["eval_aniso/eval/uniq"])
        assert f["eval_aniso/eval/ppl"] > 1.0 and f["eval_aniso/eval/ppl_rare"] > 1.0
        # the eval metrics score the decoder's own labels, unshifted: the quick validation set is one
        # evaluation batch, so the Trainer's eval_loss is the same token mean
        assert f["eval_aniso/eval/ppl"] == pytest.approx(math.exp(f["eval_loss"]), rel=1e-4)
        assert r["examples"] and all(e["reference"] for e in r["examples"])  # translations were decoded to words
    # AGG was on in the agg run only: its gated head leaves the geometry different from MLE's
    assert runs[0]["final"]["aniso/geometry/head/isotropy"] != runs[1]["final"]["aniso/geometry/head/isotropy"]

    table = (out / "results.md").read_text()
    assert "| method | seeds | BLEU |" in table and "I(W)" in table and "Uniq" in table
    for r in runs:  # one seed: the table shows the run's own value, and the same table was printed
        assert f"| {r['method']} | 1 | {r['final']['bleu']:.4g} |" in table
    assert table.split("\n\n", 1)[1].strip() in stdout
    assert "[1/2] mle, seed 0" in stdout and "[2/2] agg, seed 0" in stdout

    # the same command again resumes: nothing is retrained, the runs are kept as they were
    start = time.perf_counter()
    again = run_example("translation.py", *args)
    assert "resuming: 2 of 2 runs" in again and "[1/2]" not in again and "[2/2]" not in again
    assert json.loads((out / "results.json").read_text()) == runs
    assert (out / "results.md").read_text() == table
    assert time.perf_counter() - start < first

    # a narrower command keeps the other method's run in results.json
    run_example("translation.py", *args[:2], "mle", *args[3:])
    assert json.loads((out / "results.json").read_text()) == runs


@pytest.mark.parametrize(
    "flags, message",
    [
        (("--methods", "mle,bogus"), "unknown: bogus"),
        (("--methods", ""), "expected a comma-separated list of mle, agg"),
        (("--seeds", "0,x"), "expected comma-separated integers"),
        (("--seeds", "-1"), "integers >= 0"),
        (("--steps", "0"), "expected an integer > 0"),
        (("--zipf", "nan"), "expected a number > 0"),
        (("--words", "5"), "--words 5: expected at least"),
        (("--d-model", "30"), "expected a multiple of 4"),
        (("--label-smoothing", "1"), "--label-smoothing 1.0: expected a number in [0, 1)"),
        (("--window", "0"), "expected an integer > 0"),
    ],
)
def test_bad_arguments_are_argparse_errors(flags, message, capsys):
    from translation import parse_args

    with pytest.raises(SystemExit) as exit_info:
        parse_args(list(flags))
    assert exit_info.value.code == 2 and message in capsys.readouterr().err
