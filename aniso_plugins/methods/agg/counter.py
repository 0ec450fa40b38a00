"""AGG's token counter memory: target counts over the last K optimizer steps (docs/methods.md §1.1).

The official code (``ysw1021/AGG``, ``fairseq/criterions/cross_entropy_agg.py``) keeps a dense
(K+1)×V float ring buffer ``M``; on every micro-batch of step t (1-based) it zeroes row
``t mod (K+1)``, adds the micro-batch's target counts to row ``(t-1) mod (K+1)`` and reads

    c_k = Σ_rows M[·, k],        a_k = c_k / min(t, K),        a_k := 1 for special ids,

i.e. the counts of the last ≤ K steps, the current (possibly partial) step included. AGG counts
an optimizer step's micro-batches together before the first is gated (the whole step, as one
batch or as DDP ranks see it; docs/methods.md §1.1).

`SlidingTokenCounter` returns exactly the same ``a`` (same float32 division of the same integers) but
stores what the window really holds, where a training step never waits for it: the running total
over the window and the current step's counts live on the model's device (counted with
``index_add_``, checked with ``torch._assert_async``: no host read); each completed step is copied
to the host asynchronously and kept there as a sparse (ids, counts) pair, resolved a step later
(when its copy has long arrived). Ending a step costs O(V) on the device plus O(tokens of the
evicted step) on the host; nothing is O(K·V).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping, Sequence

import numpy as np
import torch
import torch.distributed as dist

from aniso_plugins.core.targets import count_targets
from aniso_plugins.numerics.host_copy import HostCopy, to_device

__all__ = ["SlidingTokenCounter"]


def _compact(ids: np.ndarray, counts: np.ndarray, vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Smallest integer dtypes that hold the ids (< vocab_size) and the counts exactly."""
    id_type = np.int16 if vocab_size <= 2**15 else np.uint16 if vocab_size <= 2**16 else np.int32
    top = int(counts.max()) if counts.size else 0
    return ids.astype(id_type), counts.astype(np.int16 if top < 2**15 else np.int32)


class _Step:
    """One completed step's counts: on the device until resolved (`device`, with its copy to the
    host under way), then a sparse (ids, counts) pair on the host."""

    def __init__(self, counts: torch.Tensor | None = None, sparse: tuple[np.ndarray, np.ndarray] | None = None) -> None:
        self.device = counts
        self._copy = HostCopy(counts) if counts is not None else None
        self._sparse = sparse

    def sparse(self, vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
        """The (ids, counts) pair (waits for the copy to the host, if it is still under way)."""
        if self._sparse is None:
            if self._copy is None:
                self._sparse = (np.zeros(0, np.int16), np.zeros(0, np.int16))
            else:
                dense = self._copy.result()
                ids = np.flatnonzero(dense)
                self._sparse = _compact(ids, dense[ids], vocab_size)
            self.device = self._copy = None
        return self._sparse

    @property
    def nbytes(self) -> int:
        if self._sparse is not None:
            return self._sparse[0].nbytes + self._sparse[1].nbytes
        return self._copy.nbytes if self._copy is not None else 0


class SlidingTokenCounter:
    """Counts of target ids over the last `window` optimizer steps (AGG's token counter memory).

    Args:
        vocab_size: V, number of ids.
        window: K, optimizer steps remembered (the official code: updates per epoch).
        always_frequent: ids whose appearance is forced to 1 (fairseq's specials).
        ignore_index: target value that is never counted.
        device: where the running counts live (the model's: the targets' device).

    Protocol per optimizer step t = 1, 2, ...: `update` with the step's training targets (AGG
    counts the step's micro-batches together, before the first forward), `appearance` whenever
    gates are needed (it includes what was counted of step t), `step` after the optimizer step.
    None of them reads a value back to the host; `counts`, `appearance` and friends return
    tensors on `device`. `state_dict`, `nbytes` and `tokens_per_step` read (call them at
    measurement or checkpoint time).
    """

    def __init__(
        self,
        vocab_size: int,
        window: int,
        *,
        always_frequent: Iterable[int] = (),
        ignore_index: int = -100,
        device: torch.device | str = "cpu",
    ) -> None:
        if not isinstance(vocab_size, int) or isinstance(vocab_size, bool) or vocab_size < 1:
            raise ValueError(f"vocab_size={vocab_size!r}: expected an integer >= 1")
        if not isinstance(window, int) or isinstance(window, bool) or window < 1:
            raise ValueError(f"window={window!r}: expected an integer >= 1 (optimizer steps remembered)")
        always = tuple(dict.fromkeys(int(i) for i in always_frequent))  # distinct, in order
        bad = [i for i in always if not 0 <= i < vocab_size]
        if bad:
            raise ValueError(f"always_frequent={always!r}: ids {bad} are outside [0, {vocab_size})")
        self.vocab_size = vocab_size
        self.window = window
        self.always_frequent = always
        self.ignore_index = ignore_index
        self.device = torch.device(device)
        self._always = torch.tensor(always, dtype=torch.int64, device=self.device)
        self._t = 1
        self._total = torch.zeros(vocab_size, dtype=torch.int64, device=self.device)
        self._ring: deque[_Step] = deque()  # completed steps, oldest first
        self._current: torch.Tensor | None = None  # dense counts of step t, on the device
        self._newest: torch.Tensor | None = None  # int32 counts of step t − 1, kept for reporting (K = 1 keeps no ring)

    # --- reading ------------------------------------------------------------------------------
    @property
    def step_index(self) -> int:
        """t, the 1-based index of the step being counted (completed `step` calls + 1)."""
        return self._t

    @property
    def steps_in_window(self) -> int:
        """min(t, K): the divisor of the appearance."""
        return min(self._t, self.window)

    @property
    def always_frequent_ids(self) -> torch.Tensor:
        """`always_frequent` as int64 ids on the device."""
        return self._always

    def counts(self) -> torch.Tensor:
        """c, int64 (V,): occurrences of each id in the last ≤ K steps, the current one included."""
        return self._total.clone()

    def _with_specials(self, a: torch.Tensor) -> torch.Tensor:
        return a.index_fill_(0, self._always, 1.0) if self._always.numel() else a

    def appearance(self) -> torch.Tensor:
        """a, float32 (V,): a_k = c_k / min(t, K), and 1 for `always_frequent` ids.

        Same float32 arithmetic as the official ``word_count.sum(0) / min(itr, K)``
        (docs/methods.md §1.1; exact for counts below 2**24)."""
        return self._with_specials(self._total.to(torch.float32) / self.steps_in_window)

    def appearance_per_tokens(self, tokens: int) -> torch.Tensor:
        """a, float32 (V,): the appearance per `tokens` target tokens instead of per step,
        a_k = tokens · c_k / Σ_j c_j = (c_k / min(t, K)) · tokens / T̄ with T̄ = Σ_j c_j / min(t, K)
        the mean target tokens per step over the window; 1 for `always_frequent` ids; 0 before
        anything was counted. Equals `appearance` (bit for bit) when T̄ = tokens."""
        total = self._total.sum()
        scaled = self._total.to(torch.float64) * (tokens / total.clamp_min(1).to(torch.float64))
        per_step = (total == 0) | (total == tokens * self.steps_in_window)
        return torch.where(per_step, self.appearance(), self._with_specials(scaled.to(torch.float32)))

    def tokens_per_step(self) -> float:
        """T̄ = Σ_j c_j / min(t, K): the mean (global) target tokens per step over the window (a read)."""
        return int(self._total.sum()) / self.steps_in_window

    def newest_step_counts(self) -> torch.Tensor:
        """int64 (V,) on the device: the counts of the newest completed step (after `step`), else
        of the current one."""
        if self._current is not None:
            return self._current.clone()
        if self._newest is not None:
            return self._newest.to(torch.int64)
        if not self._ring:
            return torch.zeros_like(self._total)
        newest = self._ring[-1]
        if newest.device is not None:
            return newest.device.to(torch.int64)
        return self._dense(*newest.sparse(self.vocab_size))

    def _dense(self, ids: np.ndarray, counts: np.ndarray) -> torch.Tensor:
        """A sparse host pair as dense int64 counts on the device."""
        dense = np.zeros(self.vocab_size, dtype=np.int64)
        dense[ids.astype(np.int64)] = counts
        return to_device(dense, self.device)

    @property
    def nbytes(self) -> int:
        """Bytes held: the running total, the current step's counts and the window's sparse
        steps (resolving the copies still under way: a read)."""
        held = self._total.nbytes + self._always.nbytes
        held += self._current.nbytes if self._current is not None else 0
        for entry in self._ring:
            entry.sparse(self.vocab_size)
            held += entry.nbytes
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
        of the step, counted together), on any device (they are counted on the counter's).

        Positions equal to `ignore_index` are skipped; any other value must lie in [0, V)
        (`count_targets`: no host read; a `ValueError` on the CPU). With ``all_reduce=True`` (collective: every rank of
        `group` must call it for its targets) the counts are summed across the ranks first, with
        one all_reduce of a V-vector of int64 on the device, so every rank holds the same counts
        and computes the same gates."""
        counts = count_targets(targets, self.vocab_size, self.ignore_index, self.device)
        if all_reduce:
            dist.all_reduce(counts, op=dist.ReduceOp.SUM, group=group)
        self._total += counts
        self._current = counts if self._current is None else self._current + counts

    def step(self) -> None:
        """End optimizer step t: it joins the window (its counts copied to the host
        asynchronously), the step t−K+1 leaves it, t ← t+1. The step before it, whose copy has
        had a whole step to arrive, is resolved into its sparse pair."""
        counts = self._current.to(torch.int32) if self._current is not None else None
        self._current, self._newest = None, counts
        self._ring.append(_Step(counts))
        while len(self._ring) > self.window - 1:
            self._evict(self._ring.popleft())
        for entry in list(self._ring)[:-1]:
            if entry.device is not None:
                entry.sparse(self.vocab_size)
        self._t += 1

    def _evict(self, entry: _Step) -> None:
        if entry.device is not None:  # still on the device: no round trip
            self._total -= entry.device.to(torch.int64)
            return
        ids, counts = entry.sparse(self.vocab_size)
        if ids.size:
            self._total.index_add_(0, to_device(ids.astype(np.int64), self.device),
                                   -to_device(counts.astype(np.int64), self.device))

    # --- state --------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, torch.Tensor]:
        """Tensors only (for safetensors), on the CPU: the step index, V, K, the window's sparse
        steps (concatenated, with their sizes, oldest first) and the current step's counts."""
        steps = [entry.sparse(self.vocab_size) for entry in self._ring]
        current = self._current.cpu().numpy() if self._current is not None else np.zeros(0, np.int64)
        cur_ids = np.flatnonzero(current)

        def cat(arrays: list[np.ndarray]) -> torch.Tensor:
            return torch.from_numpy(np.concatenate([a.astype(np.int64) for a in arrays])) if arrays else torch.zeros(0, dtype=torch.int64)

        return {
            "step": torch.tensor([self._t], dtype=torch.int64),
            "vocab_size": torch.tensor([self.vocab_size], dtype=torch.int64),
            "window": torch.tensor([self.window], dtype=torch.int64),
            "sizes": torch.tensor([len(i) for i, _ in steps], dtype=torch.int64),
            "ids": cat([i for i, _ in steps]),
            "counts": cat([c for _, c in steps]),
            "current_ids": torch.from_numpy(cur_ids.astype(np.int64)),
            "current_counts": torch.from_numpy(current[cur_ids].astype(np.int64)),
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
        ids, counts = state["ids"].cpu().to(torch.int64).numpy(), state["counts"].cpu().to(torch.int64).numpy()
        cur_ids = state["current_ids"].cpu().to(torch.int64).numpy()
        cur_counts = state["current_counts"].cpu().to(torch.int64).numpy()
        sizes = [int(x) for x in state["sizes"]]
        if (
            t < 1
            or any(x < 0 for x in sizes)
            or sum(sizes) != ids.size
            or ids.shape != counts.shape
            or cur_ids.shape != cur_counts.shape
            or len(sizes) > min(t - 1, saved_window - 1)
        ):
            raise ValueError(
                f"inconsistent state: step {t}, window {saved_window}, step sizes {sizes} for {ids.size} ids "
                f"and {counts.size} counts"
            )
        for name, x in (("ids", ids), ("current_ids", cur_ids)):
            if x.size and (int(x.min()) < 0 or int(x.max()) >= v):
                raise ValueError(f"{name} outside [0, {v})")
        bounds = np.cumsum([0, *sizes])
        steps = [(ids[a:b], counts[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]
        if saved_window != self.window:
            keep = self.window - 1
            if len(steps) < keep and len(steps) != t - 1:
                raise ValueError(
                    f"saved window={saved_window} holds the last {len(steps)} completed steps; window={self.window} "
                    f"needs {keep}: the counts of the older steps are gone, so the window cannot be re-cut exactly"
                )
            steps = steps[max(len(steps) - keep, 0) :] if keep else []
        total = np.zeros(v, dtype=np.int64)
        for step_ids, step_counts in steps:
            np.add.at(total, step_ids, step_counts)
        current = np.zeros(v, dtype=np.int64)
        np.add.at(current, cur_ids, cur_counts)
        self._t = t
        self._ring = deque(_Step(sparse=_compact(i, c, v)) for i, c in steps)
        self._newest = None  # the ring's newest step reports it
        self._current = to_device(current, self.device) if cur_ids.size else None
        self._total = to_device(total + current, self.device)
