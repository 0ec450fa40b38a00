"""AGG's token counter memory: target counts over the last K optimizer steps (docs/methods.md §1.1).

The official code (``ysw1021/AGG``, ``fairseq/criterions/cross_entropy_agg.py``) keeps a dense
(K+1)×V float ring buffer ``M``; on every micro-batch of step t (1-based) it zeroes row
``t mod (K+1)``, adds the micro-batch's target counts to row ``(t-1) mod (K+1)`` and reads

    c_k = Σ_rows M[·, k],        a_k = c_k / min(t, K),        a_k := 1 for special ids,

i.e. the counts of the last ≤ K steps, the current (possibly partial) step included. AGG counts
an optimizer step's micro-batches together before the first is gated (the whole step, as one
batch or as DDP ranks see it; docs/methods.md §1.1).

`SlidingTokenCounter` returns exactly the same ``a`` (same float32 division of the same integers) but
stores what the window really holds: one sparse (ids, counts) pair per step plus a running
total over the window. An update costs O(n log n) in the n targets counted (one
sort), ending a step O(tokens of the step + tokens of the evicted step); nothing is O(K·V).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping, Sequence

import torch
import torch.distributed as dist

__all__ = ["SlidingTokenCounter"]


def _compact(ids: torch.Tensor, counts: torch.Tensor, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Smallest integer dtypes that hold the ids (< vocab_size) and the counts exactly."""
    if vocab_size <= 2**15:
        ids = ids.to(torch.int16)
    elif vocab_size <= 2**16:
        ids = ids.to(torch.uint16)
    else:
        ids = ids.to(torch.int32)
    top = int(counts.max()) if counts.numel() else 0
    counts = counts.to(torch.int16 if top < 2**15 else torch.int32)
    return ids, counts


def _coalesce(ids: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum the counts of repeated ids; returns sorted unique int64 ids and int64 counts."""
    unique, inverse = torch.unique(ids, return_inverse=True)
    summed = torch.zeros(unique.numel(), dtype=torch.int64).index_add_(0, inverse, counts.to(torch.int64))
    return unique, summed


class SlidingTokenCounter:
    """Counts of target ids over the last `window` optimizer steps (AGG's token counter memory).

    Args:
        vocab_size: V, number of ids.
        window: K, optimizer steps remembered (the official code: updates per epoch).
        always_frequent: ids whose appearance is forced to 1 (fairseq's specials).
        ignore_index: target value that is never counted.

    Protocol per optimizer step t = 1, 2, ...: `update` with the step's training targets (AGG
    counts the step's micro-batches together, before the first forward), `appearance` whenever
    gates are needed (it includes what was counted of step t), `step` after the optimizer step. Storage is on the CPU whatever the targets' device.
    """

    def __init__(
        self,
        vocab_size: int,
        window: int,
        *,
        always_frequent: Iterable[int] = (),
        ignore_index: int = -100,
    ) -> None:
        if not isinstance(vocab_size, int) or isinstance(vocab_size, bool) or vocab_size < 1:
            raise ValueError(f"vocab_size={vocab_size!r}: expected an integer >= 1")
        if not isinstance(window, int) or isinstance(window, bool) or window < 1:
            raise ValueError(f"window={window!r}: expected an integer >= 1 (optimizer steps remembered)")
        always = tuple(int(i) for i in always_frequent)
        bad = [i for i in always if not 0 <= i < vocab_size]
        if bad:
            raise ValueError(f"always_frequent={always!r}: ids {bad} are outside [0, {vocab_size})")
        self.vocab_size = vocab_size
        self.window = window
        self.always_frequent = always
        self.ignore_index = ignore_index
        self._always = torch.tensor(always, dtype=torch.int64)
        self._t = 1
        self._total = torch.zeros(vocab_size, dtype=torch.int64)
        self._ring: deque[tuple[torch.Tensor, torch.Tensor]] = deque()  # completed steps, oldest first
        self._current: list[tuple[torch.Tensor, torch.Tensor]] = []  # what was counted of step t

    # --- reading ------------------------------------------------------------------------------
    @property
    def step_index(self) -> int:
        """t, the 1-based index of the step being counted (completed `step` calls + 1)."""
        return self._t

    @property
    def steps_in_window(self) -> int:
        """min(t, K): the divisor of the appearance."""
        return min(self._t, self.window)

    def counts(self) -> torch.Tensor:
        """c, int64 (V,): occurrences of each id in the last ≤ K steps, the current one included."""
        return self._total.clone()

    def appearance(self) -> torch.Tensor:
        """a, float32 (V,): a_k = c_k / min(t, K), and 1 for `always_frequent` ids.

        Same float32 arithmetic as the official ``word_count.sum(0) / min(itr, K)``
        (docs/methods.md §1.1; exact for counts below 2**24)."""
        a = self._total.to(torch.float32) / self.steps_in_window
        if self._always.numel():
            a[self._always] = 1.0
        return a

    def appearance_per_tokens(self, tokens: int) -> torch.Tensor:
        """a, float32 (V,): the appearance per `tokens` target tokens instead of per step,
        a_k = tokens · c_k / Σ_j c_j = (c_k / min(t, K)) · tokens / T̄ with T̄ = Σ_j c_j / min(t, K)
        the mean target tokens per step over the window; 1 for `always_frequent` ids; 0 before
        anything was counted. Equals `appearance` when T̄ = tokens."""
        total = int(self._total.sum())
        if total == 0 or tokens * self.steps_in_window == total:
            return self.appearance()  # T̄ = tokens: the per-step appearance, the same float32 arithmetic
        a = (self._total.to(torch.float64) * (tokens / total)).to(torch.float32)
        if self._always.numel():
            a[self._always] = 1.0
        return a

    def tokens_per_step(self) -> float:
        """T̄ = Σ_j c_j / min(t, K): the mean (global) target tokens per step over the window."""
        return int(self._total.sum()) / self.steps_in_window

    def newest_step_counts(self) -> torch.Tensor:
        """int64 (V,): the counts of the newest completed step (after `step`), else of the
        current one."""
        dense = torch.zeros(self.vocab_size, dtype=torch.int64)
        entries = [self._ring[-1]] if self._ring and not self._current else self._current
        for ids, counts in entries:
            dense.index_add_(0, ids.to(torch.int64), counts.to(torch.int64))
        return dense

    @property
    def nbytes(self) -> int:
        """Bytes held: the running total plus the sparse per-step counts of the window."""
        held = self._total.nbytes + self._always.nbytes
        for ids, counts in list(self._ring) + self._current:
            held += ids.nbytes + counts.nbytes
        return held

    # --- writing ------------------------------------------------------------------------------
    def update(
        self,
        targets: torch.Tensor | Sequence[torch.Tensor],
        *,
        all_reduce: bool = False,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        """Add training targets to the current step: one tensor, or several (the micro-batches
        of the step, counted together).

        Positions equal to `ignore_index` are skipped; any other value must lie in [0, V).
        With ``all_reduce=True`` (collective: every rank of `group` must call it for its
        targets) the counts are summed across the ranks first, with one all_reduce of a
        V-vector of int64 on the targets' device, so every rank holds the same counts and
        computes the same gates."""
        parts = [targets] if isinstance(targets, torch.Tensor) else list(targets)
        for part in parts:
            if part.dtype.is_floating_point or part.dtype.is_complex or part.dtype == torch.bool:
                raise TypeError(f"targets: expected an integer tensor of token ids, got dtype {part.dtype}")
        if not parts:
            parts = [torch.zeros(0, dtype=torch.int64)]
        device = parts[0].device
        flat = torch.cat([p.detach().reshape(-1).to(device, torch.int64) for p in parts])
        flat = flat[flat != self.ignore_index]
        if flat.numel():
            lo, hi = int(flat.min()), int(flat.max())
            if lo < 0 or hi >= self.vocab_size:
                raise ValueError(
                    f"targets: ids must be in [0, {self.vocab_size}) or equal ignore_index={self.ignore_index}; "
                    f"got values in [{lo}, {hi}]"
                )
        if all_reduce:
            dense = torch.bincount(flat.to(torch.int64), minlength=self.vocab_size)
            dist.all_reduce(dense, op=dist.ReduceOp.SUM, group=group)
            dense = dense.cpu()
            ids = dense.nonzero().squeeze(1)
            counts = dense[ids]
        else:
            ids, counts = torch.unique(flat.cpu().to(torch.int64), return_counts=True)
        if ids.numel() == 0:
            return
        self._total.index_add_(0, ids, counts)
        self._current.append(_compact(ids, counts, self.vocab_size))

    def step(self) -> None:
        """End optimizer step t: it joins the window, the step t−K+1 leaves it, t ← t+1."""
        if self._current:
            ids = torch.cat([i.to(torch.int64) for i, _ in self._current])
            counts = torch.cat([c.to(torch.int64) for _, c in self._current])
            entry = _compact(*_coalesce(ids, counts), self.vocab_size)
        else:
            entry = (torch.zeros(0, dtype=torch.int16), torch.zeros(0, dtype=torch.int16))
        self._current = []
        self._ring.append(entry)
        while len(self._ring) > self.window - 1:
            old_ids, old_counts = self._ring.popleft()
            self._total.index_add_(0, old_ids.to(torch.int64), -old_counts.to(torch.int64))
        self._t += 1

    # --- state --------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, torch.Tensor]:
        """Tensors only (for safetensors): the step index, V, K, the window's sparse steps
        (concatenated, with their sizes, oldest first) and the current step's counts."""
        steps = list(self._ring)
        if self._current:
            ids = torch.cat([i.to(torch.int64) for i, _ in self._current])
            counts = torch.cat([c.to(torch.int64) for _, c in self._current])
            cur_ids, cur_counts = _coalesce(ids, counts)
        else:
            cur_ids = cur_counts = torch.zeros(0, dtype=torch.int64)
        return {
            "step": torch.tensor([self._t], dtype=torch.int64),
            "vocab_size": torch.tensor([self.vocab_size], dtype=torch.int64),
            "window": torch.tensor([self.window], dtype=torch.int64),
            "sizes": torch.tensor([len(i) for i, _ in steps], dtype=torch.int64),
            "ids": torch.cat([i.to(torch.int64) for i, _ in steps]) if steps else torch.zeros(0, dtype=torch.int64),
            "counts": torch.cat([c.to(torch.int64) for _, c in steps]) if steps else torch.zeros(0, dtype=torch.int64),
            "current_ids": cur_ids,
            "current_counts": cur_counts,
        }

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Restore `state_dict()` output; V must match this counter's.

        A state saved with another window K' (the epoch length changed with the batch size,
        the number of ranks or the accumulation) is re-cut to this counter's K exactly when it
        can be: the state holds the last min(t − 1, K' − 1) completed steps one by one, so the
        last K − 1 of them are available when K ≤ K', or when every step since the start is
        stored (t ≤ K'). Otherwise it raises `ValueError` (the counts of the missing steps were
        dropped when they left the old window). The state is checked completely before this
        counter changes."""
        keys = {"step", "vocab_size", "window", "sizes", "ids", "counts", "current_ids", "current_counts"}
        missing = keys - set(state)
        if missing:
            raise ValueError(f"missing keys {sorted(missing)}")
        v, saved_window, t = int(state["vocab_size"][0]), int(state["window"][0]), int(state["step"][0])
        if v != self.vocab_size:
            raise ValueError(f"saved vocab_size={v}, this counter has vocab_size={self.vocab_size}")
        ids, counts = state["ids"].to(torch.int64), state["counts"].to(torch.int64)
        cur_ids, cur_counts = state["current_ids"].to(torch.int64), state["current_counts"].to(torch.int64)
        sizes = [int(x) for x in state["sizes"]]
        if (
            t < 1
            or any(x < 0 for x in sizes)
            or sum(sizes) != ids.numel()
            or ids.shape != counts.shape
            or cur_ids.shape != cur_counts.shape
            or len(sizes) > min(t - 1, saved_window - 1)
        ):
            raise ValueError(
                f"inconsistent state: step {t}, window {saved_window}, step sizes {sizes} for {ids.numel()} ids "
                f"and {counts.numel()} counts"
            )
        for name, x in (("ids", ids), ("current_ids", cur_ids)):
            if x.numel() and (int(x.min()) < 0 or int(x.max()) >= v):
                raise ValueError(f"{name} outside [0, {v})")
        steps = list(zip(ids.split(sizes), counts.split(sizes)))
        if saved_window != self.window:
            keep = self.window - 1
            if len(steps) < keep and len(steps) != t - 1:
                raise ValueError(
                    f"saved window={saved_window} holds the last {len(steps)} completed steps; window={self.window} "
                    f"needs {keep}: the counts of the older steps are gone, so the window cannot be re-cut exactly"
                )
            steps = steps[max(len(steps) - keep, 0) :] if keep else []
        self._t = t
        self._total = torch.zeros(self.vocab_size, dtype=torch.int64)
        self._ring = deque()
        for step_ids, step_counts in steps:
            self._total.index_add_(0, step_ids, step_counts)
            self._ring.append(_compact(step_ids, step_counts, v))
        self._current = []
        if cur_ids.numel():
            self._total.index_add_(0, cur_ids, cur_counts)
            self._current.append(_compact(cur_ids, cur_counts, v))
