"""Run a function on N real torch.distributed (gloo) processes and collect what each returns."""

from __future__ import annotations

import os
import pickle
import socket
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, out_dir, fn, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    result = None
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        result = ("ok", fn(rank, world, *args))
    except BaseException:  # noqa: BLE001 - report to the parent
        result = ("error", traceback.format_exc())
    finally:
        with open(os.path.join(out_dir, f"{rank}.pkl"), "wb") as f:
            pickle.dump(result, f)
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn, *args, world: int = 2) -> list:
    """Call ``fn(rank, world, *args)`` on `world` gloo processes; return the results by rank.
    `fn` must be importable (module level). Raises with the worker's traceback on failure."""
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(_worker, args=(world, _free_port(), out_dir, fn, args), nprocs=world, start_method="spawn")
        results = []
        for r in range(world):
            with open(os.path.join(out_dir, f"{r}.pkl"), "rb") as f:
                status, value = pickle.load(f)
            if status != "ok":
                raise AssertionError(f"rank {r} failed:\n{value}")
            results.append(value)
    return results
