"""Run a function on N real torch.distributed (gloo) processes and collect what each returns."""

from __future__ import annotations

import os
import pickle
import sys
import tempfile
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(rank, world, out_dir, fn, args):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    result = None
    try:
        # a file store: no TCP port to pick (and lose to a race with other tests)
        store = f"file://{os.path.join(out_dir, 'store')}"
        dist.init_process_group("gloo", init_method=store, rank=rank, world_size=world, timeout=timedelta(seconds=120))
        result = ("ok", fn(rank, world, *args))
    except BaseException:  # noqa: BLE001 - report to the parent
        result = ("error", traceback.format_exc())
    finally:
        with open(os.path.join(out_dir, f"{rank}.pkl"), "wb") as f:
            pickle.dump(result, f)
        if dist.is_initialized():
            if result[0] == "ok":
                dist.barrier()  # no rank tears down gloo while the other still communicates
            dist.destroy_process_group()
    # Skip the interpreter's teardown: destructors of torch's C++ thread pools at exit can abort
    # ("terminate called without an active exception") after the work is done and reported.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_distributed(fn, *args, world: int = 2) -> list:
    """Call ``fn(rank, world, *args)`` on `world` gloo processes; return the results by rank.
    `fn` must be importable (module level). Raises with the worker's traceback on failure."""
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(_worker, args=(world, out_dir, fn, args), nprocs=world, start_method="spawn")
        results = []
        for r in range(world):
            with open(os.path.join(out_dir, f"{r}.pkl"), "rb") as f:
                status, value = pickle.load(f)
            if status != "ok":
                raise AssertionError(f"rank {r} failed:\n{value}")
            results.append(value)
    return results
