"""SlidingTokenCounter against the official dense (K+1)×V ring buffer (docs/methods.md §1.1), written out
here as the official criterion does it, on random streams with gradient accumulation,
ignored positions and many wrap-arounds; state round trips; memory; bad inputs."""

from __future__ import annotations

import pytest
import torch

from aniso_plugins import SlidingTokenCounter


class DenseRing:
    """The official ``word_count`` buffer (``cross_entropy_agg.py``), one call per micro-batch."""

    def __init__(self, vocab, window, specials=(), ignore_index=-100):
        self.M = torch.zeros(window + 1, vocab)
        self.K = window
        self.specials = list(specials)
        self.ignore_index = ignore_index

    def criterion_call(self, targets, itr):
        t = targets.reshape(-1)
        t = t[t != self.ignore_index]
        row = itr % (self.K + 1)
        self.M[row] = 0
        for tok in t.tolist():  # one count per position, duplicates included
            self.M[row - 1, tok] += 1  # row - 1 == -1 wraps to row K, as in Python/torch indexing
        f1 = self.M.sum(0) / min(itr, self.K)
        f1[self.specials] = 1.0
        return f1


def _stream(seed, vocab, steps, max_micro, max_len, skew):
    g = torch.Generator().manual_seed(seed)
    probs = torch.arange(1, vocab + 1, dtype=torch.float64).pow(-skew)
    for _ in range(steps):
        micro = []
        for _ in range(int(torch.randint(1, max_micro + 1, (1,), generator=g))):
            n = int(torch.randint(0, max_len + 1, (1,), generator=g))
            t = torch.multinomial(probs, n, replacement=True, generator=g) if n else torch.zeros(0, dtype=torch.int64)
            t[torch.rand(n, generator=g) < 0.1] = -100
            micro.append(t)
        yield micro


@pytest.mark.parametrize(
    "vocab, window, specials, skew, steps",
    [
        (13, 1, (), 0.5, 12),  # K = 1: only the current step
        (17, 3, (0, 2), 1.0, 25),  # many wrap-arounds
        (40, 7, (1,), 1.2, 30),
        (300, 5, (), 0.0, 14),  # uniform, mostly-distinct ids
    ],
)
def test_equals_dense_ring_buffer(vocab, window, specials, skew, steps):
    ref = DenseRing(vocab, window, specials)
    counter = SlidingTokenCounter(vocab, window, always_frequent=specials)
    for t, micro in enumerate(_stream(vocab + window, vocab, steps, 3, 9, skew), start=1):
        assert counter.step_index == t and counter.steps_in_window == min(t, window)
        for targets in micro:
            counter.update(targets.reshape(1, -1))
            expected = ref.criterion_call(targets, t)
            got = counter.appearance()
            assert got.dtype == torch.float32
            assert torch.equal(got, expected), (t, got, expected)
        counter.step()


def test_counts_of_last_k_steps_brute_force():
    """After K + 5 steps the counts are the brute-force counts of the last K steps (docs/methods.md §11)."""
    vocab, window = 11, 4
    counter = SlidingTokenCounter(vocab, window)
    history = []
    for micro in _stream(3, vocab, window + 5, 2, 6, 0.7):
        for targets in micro:
            counter.update(targets)
        history.append(torch.cat(micro))
        counter.step()
    # the current step (t = K + 6) has no micro-batch yet: the window is steps K+3 .. K+5
    recent = torch.cat(history[-(window - 1) :])
    recent = recent[recent != -100]
    assert torch.equal(counter.counts(), torch.bincount(recent, minlength=vocab))


def test_state_round_trip_mid_step_continues_identically():
    vocab, window = 23, 4
    a, b = SlidingTokenCounter(vocab, window, always_frequent=(3,)), None
    stream = list(_stream(11, vocab, 16, 3, 8, 1.0))
    for t, micro in enumerate(stream, start=1):
        for m, targets in enumerate(micro):
            a.update(targets)
            if t == 9 and m == 0:  # save in the middle of a step (partial counts)
                state = {k: v.clone() for k, v in a.state_dict().items()}
                b = SlidingTokenCounter(vocab, window, always_frequent=(3,))
                b.load_state_dict(state)
                assert torch.equal(b.appearance(), a.appearance()) and b.step_index == a.step_index
            elif b is not None:
                b.update(targets)
            if b is not None:
                assert torch.equal(b.appearance(), a.appearance())
        a.step()
        if b is not None:
            b.step()
    assert torch.equal(a.counts(), b.counts())


def _run(window, stream):
    counter = SlidingTokenCounter(23, window)
    for micro in stream:
        for m in micro:
            counter.update(m)
        counter.step()
    return counter


@pytest.mark.parametrize("saved_window, steps, new_window", [(6, 9, 3), (6, 9, 1), (6, 4, 8), (2, 1, 5)])
def test_load_state_recuts_another_window_exactly_when_the_steps_are_stored(saved_window, steps, new_window):
    stream = list(_stream(5, 23, steps, 2, 7, 0.8))
    resumed = SlidingTokenCounter(23, new_window)
    resumed.load_state_dict(_run(saved_window, stream).state_dict())
    reference = _run(new_window, stream)  # a run that had the new window all along
    assert resumed.step_index == reference.step_index
    assert torch.equal(resumed.counts(), reference.counts())
    more = list(_stream(6, 23, new_window + 2, 2, 7, 0.8))
    for micro in more:  # and it keeps evicting exactly
        for m in micro:
            resumed.update(m)
            reference.update(m)
        resumed.step()
        reference.step()
        assert torch.equal(resumed.counts(), reference.counts())


def test_load_state_refuses_what_it_cannot_recut_or_read():
    stream = list(_stream(5, 23, 9, 2, 7, 0.8))
    state = _run(6, stream).state_dict()  # holds the last 5 completed steps of 8
    with pytest.raises(ValueError, match="window=8 needs 7"):
        SlidingTokenCounter(23, 8).load_state_dict(state)
    with pytest.raises(ValueError, match="vocab_size=23"):
        SlidingTokenCounter(24, 6).load_state_dict(state)
    with pytest.raises(ValueError, match="missing keys"):
        SlidingTokenCounter(23, 6).load_state_dict({"step": state["step"]})
    tampered = dict(state, sizes=state["sizes"] + 1)
    untouched = _run(6, stream)
    before = untouched.counts()
    with pytest.raises(ValueError, match="inconsistent state"):
        untouched.load_state_dict(tampered)
    assert torch.equal(untouched.counts(), before)  # checked before anything changed
    with pytest.raises(ValueError, match=r"ids outside \[0, 23\)"):
        SlidingTokenCounter(23, 6).load_state_dict(dict(state, ids=state["ids"] + 100))


def test_memory_holds_only_the_window():
    vocab, window = 50_000, 6
    counter = SlidingTokenCounter(vocab, window)
    sizes = []
    for step in range(20):
        counter.update(torch.arange(100).repeat(5) + step)  # 100 distinct ids per step
        counter.step()
        sizes.append(counter.nbytes)
    dense = (window + 1) * vocab * 4
    # total (V int64) + K-1 steps of 100 (int16 id, int16 count) pairs
    assert sizes[-1] == vocab * 8 + (window - 1) * 100 * 4
    assert sizes[-1] < dense / 3
    assert sizes[-1] == sizes[-2] == sizes[window]  # bounded once the window is full


def test_compact_dtypes_are_exact_for_large_ids_and_counts():
    vocab = 70_000  # ids need int32
    counter = SlidingTokenCounter(vocab, 2)
    targets = torch.cat([torch.full((40_000,), 69_999), torch.tensor([0, 65_535, 65_536])])  # count 40000 > int16
    counter.update(targets)
    counter.step()
    c = counter.counts()
    assert int(c[69_999]) == 40_000 and int(c[65_536]) == 1 and int(c[0]) == 1 and int(c.sum()) == 40_003
    state = counter.state_dict()
    other = SlidingTokenCounter(vocab, 2)
    other.load_state_dict(state)
    assert torch.equal(other.counts(), c)
    for _ in range(2):
        counter.step()
    assert int(counter.counts().sum()) == 0  # evicted exactly


@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        ({"vocab_size": 0, "window": 3}, ValueError, ["vocab_size=0"]),
        ({"vocab_size": 5, "window": 0}, ValueError, ["window=0"]),
        ({"vocab_size": 5, "window": 2, "always_frequent": (5,)}, ValueError, ["always_frequent", "[5]"]),
    ],
)
def test_constructor_errors(kwargs, error, words):
    with pytest.raises(error) as e:
        SlidingTokenCounter(**kwargs)
    for w in words:
        assert w in str(e.value)


def test_update_errors():
    counter = SlidingTokenCounter(5, 2)
    with pytest.raises(ValueError, match=r"\[0, 5\).*\[0, 7\]"):
        counter.update(torch.tensor([0, 7]))
    with pytest.raises(ValueError, match=r"\[-3, 1\]"):
        counter.update(torch.tensor([-3, 1, -100]))
    with pytest.raises(TypeError, match="integer"):
        counter.update(torch.tensor([0.0, 1.0]))
    counter.update(torch.tensor([-100, -100]))  # only ignored positions: nothing counted
    assert int(counter.counts().sum()) == 0


@pytest.mark.parametrize("window", [1, 2, 5])
def test_the_newest_completed_step_is_reported_whatever_the_window(window):
    """After `step`, `newest_step_counts` is the step just completed, also with K = 1 (which keeps
    no completed step in its window: AGG's ``rare_target_fraction`` read 0/0 = nan in a one-step
    epoch)."""
    counter = SlidingTokenCounter(10, window=window)
    for ids in ([1, 1, 2, -100], [3, 3, 3, 9]):
        counter.update(torch.tensor(ids))
        counter.step()
        expected = torch.bincount(torch.tensor([i for i in ids if i >= 0]), minlength=10)
        assert torch.equal(counter.newest_step_counts(), expected)
    counter.update(torch.tensor([4]))
    assert torch.equal(counter.newest_step_counts(), torch.bincount(torch.tensor([4]), minlength=10))  # the current one
