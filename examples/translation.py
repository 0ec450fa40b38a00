"""Machine translation, the AGG paper's own setting (Yu et al. 2022, §4.2), offline: a tiny
MarianMT model trained from scratch with `transformers.Seq2SeqTrainer` and one AnisoCallback
on a synthetic translation task, MLE against AGG, several seeds.

    python examples/translation.py                              # MLE and AGG, seeds 0 1 2
    python examples/translation.py --methods agg --seeds 0      # one run
    python examples/translation.py --quick                      # a smoke run: tiny data, 40 steps
    python examples/translation.py --output-dir mt_out          # results.json, results.md there
    python examples/translation.py --label-smoothing 0.1 --alpha-tokens 65536   # as the official recipe

The task (`Language`, generated from ``--data-seed``; nothing is downloaded): source sentences
of 5-20 words drawn from a Zipf distribution (exponent ``--zipf``) over ``--words`` word ids,
so that most words are rare. Each word has a class (noun, adjective, verb, other) and a
translation: a fixed random permutation of the word ids, and every verb also emits a particle
after it (one source word -> two target words). Two reordering rules make the word order
differ: an adjective directly before a noun goes after it ("red house" -> "house red"), and
the first verb moves to the end of the sentence (SVO -> SOV). Source and target share one
vocabulary of word ids plus ``<pad>`` (0), ``</s>`` (1, eos) and ``<s>`` (2, the decoder start),
as a Marian model with a joint vocabulary does, and the decoder's head is tied to the shared
embedding: the rows AGG gates are the ones the encoder and decoder read. Target frequencies
are Zipfian too (the permutation scatters them over the ids), and the rare group of the
frequency metrics is the tail of target words seen few times, or never, in training.

The model: `MarianMTModel` from a `MarianConfig` (d_model 64, 2 + 2 layers, 4 heads, ffn 128,
sinusoidal positions up to 64, shared and tied embeddings). Methods: ``mle`` (plain
cross-entropy, ``AnisoConfig(method="none")``) and ``agg`` (``AnisoConfig(method="agg",
alpha=0.08)``, the paper's value for MT; ``--alpha``, ``--alpha-tokens`` and ``--window`` change
the agg arm), both measuring the ``geometry``, ``frequency`` and ``eval`` metrics, both with
``--label-smoothing`` (the Trainer's ``label_smoothing_factor``; the official recipe's is 0.1).
Per run: BLEU of the beam-search translations of a held-out test set (``trainer.predict``
with ``predict_with_generate``, sacrebleu on the word strings), the teacher-forced validation
perplexity overall and per frequency group, Uniq (distinct argmax predictions), I(W) of the
head and of its rare rows, the mean cosine of the head's rows and the rare-frequent cosine.
The table (mean ± std over seeds) is printed and written to ``results.md``; every run's numbers
go to ``results.json``, written after each run: running the same command on the same
``--output-dir`` again skips the runs already there (``--fresh`` starts over).

docs/results.md §5 has the 3-seed table and the run times (``--quick`` is a short run of
both methods). Validation perplexity and Uniq are teacher-forced (`trainer.evaluate()`); only the
test translations are generated.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from comparison import summary_table

PAD, EOS, BOS = 0, 1, 2  # BOS is the decoder start token (Marian's own decoder start is its pad id)
SPECIALS = ("<pad>", "</s>", "<s>")
CLASSES = ("noun", "adj", "verb", "other")
CLASS_SHARES = (0.35, 0.2, 0.2, 0.25)
PARTICLES = 3  # the verbs' particles are the translations of the 3 most frequent "other" words

# name -> AnisoConfig fields; every run measures the same metrics
METHODS: dict[str, dict] = {
    "mle": dict(method="none"),
    "agg": dict(method="agg", alpha=0.08),  # the AGG paper's alpha for machine translation
}
METRICS = ("geometry", "frequency", "eval")
AGG_OPTIONS = ("alpha", "alpha_tokens", "window")  # command-line overrides of the agg arm's AnisoConfig fields

# (label, key in a run's final metrics); evaluation metrics carry the Trainer's "eval_" prefix
COLUMNS = [
    ("BLEU", "bleu"),
    ("ppl", "eval_aniso/eval/ppl"),
    ("ppl frequent", "eval_aniso/eval/ppl_frequent"),
    ("ppl medium", "eval_aniso/eval/ppl_medium"),
    ("ppl rare", "eval_aniso/eval/ppl_rare"),
    ("Uniq", "eval_aniso/eval/uniq"),
    ("Uniq rare", "eval_aniso/eval/uniq_rare"),
    ("I(W)", "aniso/geometry/head/isotropy"),
    ("I(W) rare", "aniso/frequency/rare/isotropy"),
    ("mean cosine", "aniso/geometry/head/mean_cosine"),
    ("rare-frequent cosine", "aniso/frequency/rare_frequent_cosine"),
    ("wall (s)", "wall_s"),
]

# the two profiles; a flag given on the command line overrides its profile's value
FULL = dict(steps=2000, words=1500, train_size=40000, valid_size=500, test_size=500, batch_size=64, beams=4)
QUICK = dict(steps=40, words=1000, train_size=1280, valid_size=64, test_size=64, batch_size=32, beams=1)
QUICK_SEEDS = [0]


# --- the synthetic language -------------------------------------------------------------------
def word_string(i: int) -> str:
    """A pronounceable, unique string for word id `i` (ids 0-2 are the special tokens)."""
    if i < len(SPECIALS):
        return SPECIALS[i]
    consonants, vowels = "bdfgklmnprstvz", "aeiou"
    n, letters = i - len(SPECIALS), []
    while True:  # base-70 syllables, most significant first
        n, r = divmod(n, len(consonants) * len(vowels))
        letters.append(consonants[r // len(vowels)] + vowels[r % len(vowels)])
        if n == 0:
            break
        n -= 1
    return "".join(reversed(letters))


@dataclass
class Language:
    """The translation task of one ``--data-seed``: word classes, the lexical mapping and the
    Zipf distribution of source words. Word ids are ``len(SPECIALS) .. vocab_size - 1``."""

    words: int
    zipf: float
    seed: int

    def __post_init__(self) -> None:
        rng = np.random.default_rng(self.seed)
        self.vocab_size = len(SPECIALS) + self.words
        ids = np.arange(len(SPECIALS), self.vocab_size)
        self.word_class = np.full(self.vocab_size, -1)
        self.word_class[ids] = rng.choice(len(CLASSES), size=self.words, p=CLASS_SHARES)
        self.translation = np.arange(self.vocab_size)  # specials map to themselves
        self.translation[ids] = rng.permutation(ids)
        ranks = np.arange(1, self.words + 1, dtype=np.float64)
        self.probabilities = ranks**-self.zipf / np.sum(ranks**-self.zipf)  # id 3 the most frequent
        others = ids[self.word_class[ids] == CLASSES.index("other")]
        self.particles = self.translation[others[:PARTICLES]]

    def source_sentences(self, n: int, rng: np.random.Generator) -> list[list[int]]:
        lengths = rng.integers(5, 21, size=n)
        draws = rng.choice(self.words, size=int(lengths.sum()), p=self.probabilities) + len(SPECIALS)
        return [s.tolist() for s in np.split(draws, np.cumsum(lengths)[:-1])]

    def translate(self, source: list[int]) -> list[int]:
        """The target word ids of a source sentence (without eos)."""
        cls = [CLASSES[self.word_class[w]] for w in source]
        order = list(range(len(source)))
        i = 0
        while i + 1 < len(order):  # adjective + noun -> noun + adjective
            if cls[order[i]] == "adj" and cls[order[i + 1]] == "noun":
                order[i], order[i + 1] = order[i + 1], order[i]
                i += 2
            else:
                i += 1
        verbs = [j for j in order if cls[j] == "verb"]
        if verbs:  # the first verb goes to the end
            order.remove(verbs[0])
            order.append(verbs[0])
        target = []
        for j in order:
            target.append(int(self.translation[source[j]]))
            if cls[j] == "verb":  # a verb and its particle
                target.append(int(self.particles[source[j] % PARTICLES]))
        return target

    def pairs(self, n: int, seed: int) -> list[tuple[list[int], list[int]]]:
        rng = np.random.default_rng([self.seed, seed])
        return [(s, self.translate(s)) for s in self.source_sentences(n, rng)]

    def text(self, ids) -> str:
        """Word strings of the ids up to the first eos, special tokens and -100 left out."""
        words = []
        for i in ids:
            i = int(i)
            if i == EOS:
                break
            if i >= len(SPECIALS):
                words.append(word_string(i))
        return " ".join(words)


class Pairs(torch.utils.data.Dataset):
    """Sentence pairs as ``{"input_ids", "labels"}`` (both end with eos); ``with_labels=False``
    gives the source side only, for translating with ``trainer.predict``."""

    def __init__(self, pairs: list[tuple[list[int], list[int]]], with_labels: bool = True) -> None:
        self.pairs, self.with_labels = pairs, with_labels

    def __len__(self) -> int:
        return len(self.pairs)

    def __getitem__(self, i: int) -> dict[str, list[int]]:
        source, target = self.pairs[i]
        item = {"input_ids": source + [EOS]}
        if self.with_labels:
            item["labels"] = target + [EOS]
        return item


def collate(items: list[dict[str, list[int]]]) -> dict[str, torch.Tensor]:
    """Right-pads ``input_ids`` with pad (plus the attention mask) and ``labels`` with -100, and
    gives ``decoder_input_ids``: the labels shifted right after the decoder start, pad for -100, as
    the model builds them from labels itself (under label smoothing the Trainer keeps the labels
    from the model, so the batch must carry them)."""
    width = max(len(x["input_ids"]) for x in items)
    batch = {
        "input_ids": torch.tensor([x["input_ids"] + [PAD] * (width - len(x["input_ids"])) for x in items]),
        "attention_mask": torch.tensor([[1] * len(x["input_ids"]) + [0] * (width - len(x["input_ids"])) for x in items]),
    }
    if "labels" in items[0]:
        width = max(len(x["labels"]) for x in items)
        batch["labels"] = torch.tensor([x["labels"] + [-100] * (width - len(x["labels"])) for x in items])
        batch["decoder_input_ids"] = torch.tensor([([BOS] + x["labels"] + [PAD] * (width - len(x["labels"])))[:width] for x in items])
    return batch


# --- one run ----------------------------------------------------------------------------------
def build_model(vocab_size: int, a: argparse.Namespace):
    from transformers import GenerationConfig, MarianConfig, MarianMTModel

    config = MarianConfig(
        vocab_size=vocab_size, d_model=a.d_model, encoder_layers=a.layers, decoder_layers=a.layers,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=2 * a.d_model,
        decoder_ffn_dim=2 * a.d_model, max_position_embeddings=64, dropout=0.1, scale_embedding=True,
        pad_token_id=PAD, eos_token_id=EOS, bos_token_id=BOS, decoder_start_token_id=BOS, forced_eos_token_id=EOS,
        share_encoder_decoder_embeddings=True, tie_word_embeddings=True,
    )  # fmt: skip
    model = MarianMTModel(config)
    model.generation_config = GenerationConfig(
        decoder_start_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD, max_length=a.max_length, num_beams=a.beams
    )
    return model


def one_run(name: str, seed: int, language: Language, data: dict[str, list], a: argparse.Namespace) -> dict:
    """Train method `name` with `seed`; returns its record (final metrics, BLEU, wall time)."""
    with tempfile.TemporaryDirectory(prefix=f"aniso_mt_{name}_") as scratch:  # nothing is saved: no checkpoints
        return _train_and_score(name, seed, language, data, a, scratch)


def _train_and_score(name: str, seed: int, language: Language, data: dict[str, list], a: argparse.Namespace, scratch: str) -> dict:
    from transformers import Seq2SeqTrainer, Seq2SeqTrainingArguments
    from transformers.trainer_callback import PrinterCallback

    from aniso_plugins import AnisoConfig
    from aniso_plugins.integrations.hf import AnisoCallback

    start = time.perf_counter()
    torch.manual_seed(seed)
    model = build_model(language.vocab_size, a)
    # AGG's window K defaults to one epoch of optimizer steps, which the callback reads off the Trainer
    method = dict(METHODS[name])
    if name == "agg":
        method.update({k: getattr(a, k) for k in AGG_OPTIONS if getattr(a, k) is not None})
    config = AnisoConfig(**method, metrics=METRICS)
    args = Seq2SeqTrainingArguments(
        output_dir=scratch, max_steps=a.steps,
        per_device_train_batch_size=a.batch_size, per_device_eval_batch_size=64, learning_rate=a.lr,
        weight_decay=0.01, warmup_steps=max(1, a.steps // 10), lr_scheduler_type="cosine",
        logging_steps=max(1, a.steps // 8), eval_strategy="no", save_strategy="no", report_to="none",
        use_cpu=True, seed=seed, disable_tqdm=True, predict_with_generate=True,
        generation_max_length=a.max_length, generation_num_beams=a.beams, label_smoothing_factor=a.label_smoothing,
    )  # fmt: skip
    trainer = Seq2SeqTrainer(
        model=model, args=args, data_collator=collate, train_dataset=Pairs(data["train"]),
        eval_dataset=Pairs(data["valid"]), callbacks=[AnisoCallback(config)],
    )  # fmt: skip
    trainer.remove_callback(PrinterCallback)  # one line per run instead of the Trainer's log records
    trainer.train()
    final = {}
    for row in trainer.state.log_history:  # the last logged geometry (aniso/...) and training loss
        final.update({k: v for k, v in row.items() if k.startswith("aniso/") or k == "loss"})
    # teacher-forced validation loss plus eval_aniso/... (perplexity per frequency group, Uniq);
    # without compute_metrics the Trainer evaluates the loss only, so nothing is generated here
    final.update(trainer.evaluate())
    # BLEU: translate the test sources (no labels: the references stay here) with beam search
    test = data["test"]
    predictions = trainer.predict(Pairs(test, with_labels=False)).predictions
    hypotheses = [language.text(p) for p in predictions]
    references = [language.text(t) for _, t in test]
    final["bleu"] = corpus_bleu(hypotheses, references)
    wall = time.perf_counter() - start
    final["wall_s"] = wall
    examples = [{"source": language.text(s), "reference": r, "hypothesis": h}
                for (s, _), r, h in list(zip(test, references, hypotheses))[:3]]  # fmt: skip
    return {"method": name, "seed": seed, "wall_s": wall, "final": final, "examples": examples}


def corpus_bleu(hypotheses: list[str], references: list[str]) -> float:
    """sacrebleu's corpus BLEU (0-100) of whitespace-tokenized word strings."""
    try:
        import sacrebleu
    except ImportError:
        raise SystemExit('examples/translation.py needs sacrebleu for BLEU: pip install "sacrebleu>=2.4"') from None
    return float(sacrebleu.corpus_bleu(hypotheses, [references], tokenize="none").score)


# --- results ----------------------------------------------------------------------------------
def settings_of(a: argparse.Namespace) -> dict:
    """What makes two runs of one method and seed the same run (for resuming)."""
    keys = ("steps", "words", "zipf", "data_seed", "train_size", "valid_size", "test_size", "batch_size",
            "d_model", "layers", "lr", "beams", "max_length")  # fmt: skip
    settings = {k: getattr(a, k) for k in keys}
    # only when set: runs recorded before these options keep their settings
    settings.update({k: getattr(a, k) for k in AGG_OPTIONS if getattr(a, k) is not None})
    if a.label_smoothing:
        settings["label_smoothing"] = a.label_smoothing
    return settings


def load_runs(path: Path) -> list[dict]:
    """Every run recorded in `path` (none if it does not exist)."""
    if not path.exists():
        return []
    try:
        runs = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise SystemExit(f"cannot resume from {path} ({e}); move it away, pass --fresh or pick another --output-dir") from None
    if not isinstance(runs, list) or not all(isinstance(r, dict) and {"method", "seed", "final"} <= r.keys() for r in runs):
        raise SystemExit(f"cannot resume from {path}: not a list of runs; move it away, pass --fresh or pick another --output-dir")
    return runs


def save_runs(path: Path, runs: list[dict], kept: list[dict]) -> None:
    """Write `runs` and every run of `kept` not among them (other methods, seeds or settings),
    atomically, so that no finished run is ever lost."""
    have = {(r["method"], r["seed"], json.dumps(r["settings"], sort_keys=True)) for r in runs}
    rest = [r for r in kept if (r.get("method"), r.get("seed"), json.dumps(r.get("settings"), sort_keys=True)) not in have]
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(runs + rest, indent=1))
    os.replace(tmp, path)


# --- command line -----------------------------------------------------------------------------
def _names(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in METHODS]
    if not names or unknown:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected a comma-separated list of {', '.join(METHODS)}" + (f" (unknown: {', '.join(unknown)})" if unknown else "")
        )
    return list(dict.fromkeys(names))


def _seeds(text: str) -> list[int]:
    try:
        seeds = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated integers, e.g. 0,1,2") from None
    if not seeds or any(s < 0 for s in seeds):
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated integers >= 0, e.g. 0,1,2")
    return list(dict.fromkeys(seeds))


def _seeds_one(text: str) -> int:
    seeds = _seeds(text)
    if len(seeds) != 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected one integer >= 0")
    return seeds[0]


def _positive(kind):
    what = "an integer" if kind is int else "a number"

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: expected {what} > 0") from None
        if not (value > 0 and math.isfinite(value)):
            raise argparse.ArgumentTypeError(f"{text!r}: expected {what} > 0")
        return value

    return parse


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--methods", "--method", type=_names, default=list(METHODS), help="comma-separated: mle,agg (default both)")
    p.add_argument("--seeds", type=_seeds, default=None, help="comma-separated training seeds (default 0,1,2; --quick: 0)")
    p.add_argument("--quick", action="store_true", help="smoke run: 40 steps, 1000 words, 1280 training pairs, greedy decoding")
    p.add_argument("--output-dir", default=None, help="where results.json and results.md go (default: a new temporary folder)")
    p.add_argument("--fresh", action="store_true", help="ignore the runs already in --output-dir/results.json")
    p.add_argument("--steps", type=_positive(int), default=None, help=f"optimizer steps (default {FULL['steps']})")
    p.add_argument("--words", type=_positive(int), default=None, help=f"word ids of the joint vocabulary (default {FULL['words']})")
    p.add_argument("--zipf", type=_positive(float), default=1.1, help="Zipf exponent of the source words (default 1.1)")
    p.add_argument("--data-seed", type=_seeds_one, default=0, help="seed of the language and its sentences (default 0)")
    p.add_argument("--train-size", type=_positive(int), default=None, help=f"training pairs (default {FULL['train_size']})")
    p.add_argument("--valid-size", type=_positive(int), default=None, help=f"validation pairs (default {FULL['valid_size']})")
    p.add_argument("--test-size", type=_positive(int), default=None, help=f"test pairs for BLEU (default {FULL['test_size']})")
    p.add_argument("--batch-size", type=_positive(int), default=None, help=f"training pairs per step (default {FULL['batch_size']})")
    p.add_argument("--beams", type=_positive(int), default=None, help=f"beam size for the test translations (default {FULL['beams']})")
    p.add_argument("--d-model", type=_positive(int), default=64)
    p.add_argument("--layers", type=_positive(int), default=2, help="encoder layers = decoder layers")
    p.add_argument("--lr", type=_positive(float), default=2e-3)
    p.add_argument("--alpha-tokens", type=_positive(int), default=None,
                   help="AGG's alpha per this many target tokens (AnisoConfig.alpha_tokens; the official WMT recipe "
                        "updates on about 65536); default: per update, as the paper")  # fmt: skip
    p.add_argument("--alpha", type=_positive(float), default=None, help="AGG's alpha (default 0.08, the paper's for MT)")
    p.add_argument("--window", type=_positive(int), default=None,
                   help="AGG's window K in optimizer steps (default: one epoch, as the official code)")  # fmt: skip
    p.add_argument("--label-smoothing", type=float, default=0.0,
                   help="label smoothing of both arms' loss (the official WMT recipe: 0.1; default 0)")  # fmt: skip
    a = p.parse_args(argv)
    profile = QUICK if a.quick else FULL
    for key, value in profile.items():
        if getattr(a, key) is None:
            setattr(a, key, value)
    if a.seeds is None:
        a.seeds = QUICK_SEEDS if a.quick else [0, 1, 2]
    if a.words < 2 * len(CLASSES) * PARTICLES:
        p.error(f"--words {a.words}: expected at least {2 * len(CLASSES) * PARTICLES}")
    if not 0.0 <= a.label_smoothing < 1.0:
        p.error(f"--label-smoothing {a.label_smoothing}: expected a number in [0, 1)")
    if a.d_model % 4:
        p.error(f"--d-model {a.d_model}: expected a multiple of 4 (the model has 4 attention heads)")
    a.max_length = 48  # the longest target: 20 words, each a verb with its particle, and eos, after <s>
    return a


def main(argv: list[str] | None = None) -> list[dict]:
    a = parse_args(argv)
    directory = Path(a.output_dir) if a.output_dir else Path(tempfile.mkdtemp(prefix="aniso_mt_"))
    directory.mkdir(parents=True, exist_ok=True)
    results = directory / "results.json"
    settings = settings_of(a)
    kept = [] if a.fresh else load_runs(results)  # runs of other methods, seeds or settings stay in the file
    done = {(r["method"], r["seed"]): r for r in kept if r.get("settings") == settings}
    plan = [(m, s) for m in a.methods for s in a.seeds]
    if done:
        print(f"resuming: {sum(k in done for k in plan)} of {len(plan)} runs already in {results}", flush=True)

    language = Language(a.words, a.zipf, a.data_seed)
    data = {"train": language.pairs(a.train_size, 1), "valid": language.pairs(a.valid_size, 2), "test": language.pairs(a.test_size, 3)}
    train_targets = sum(len(t) + 1 for _, t in data["train"])
    seen = np.zeros(language.vocab_size, dtype=bool)
    for _, t in data["train"]:
        seen[t] = True
    print(
        f"task: {language.vocab_size} ids ({a.words} words), {a.train_size} training pairs ({train_targets} target "
        f"tokens; {int(seen.sum())} distinct target words), {a.steps} steps of {a.batch_size} pairs; output in {directory}",
        flush=True,
    )
    runs = []
    started = time.perf_counter()
    for i, (m, seed) in enumerate(plan, 1):
        if (m, seed) in done:
            runs.append(done[(m, seed)])
            continue
        record = one_run(m, seed, language, data, a)
        record["settings"] = settings
        runs.append(record)
        save_runs(results, runs, kept)  # after every run: an interrupted study loses at most the run in progress
        f = record["final"]
        print(
            f"[{i}/{len(plan)}] {m}, seed {seed}: BLEU {f['bleu']:.2f}, ppl {f.get('eval_aniso/eval/ppl', math.nan):.2f}, "
            f"I(W) {f.get('aniso/geometry/head/isotropy', math.nan):.3f} ({record['wall_s']:.0f} s; "
            f"{time.perf_counter() - started:.0f} s so far)",
            flush=True,
        )
    save_runs(results, runs, kept)
    table = summary_table(runs, COLUMNS)
    header = (
        f"Translation (synthetic, {a.words} Zipfian words, {a.train_size} pairs): {', '.join(a.methods)} x seeds "
        f"{','.join(map(str, a.seeds))}, {a.steps} steps, d={a.d_model}, beams {a.beams}"
        + "".join(f", {k} {v}" for k, v in settings.items() if k in (*AGG_OPTIONS, "label_smoothing"))
    )
    (directory / "results.md").write_text(f"# {header}\n\n{table}\n")
    print(f"\n{header}\n\n{table}\n\n{results}\n{directory / 'results.md'}")
    return runs


if __name__ == "__main__":
    main()
