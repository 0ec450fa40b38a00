"""Running torchtitan's real Trainer for the tests: `Launcher` runs jobs (tests/torchtitan_launcher.py
subprocesses, 1 process or torchrun) a few at a time, each after the jobs it depends on, and
`Run.result` reads what a run recorded (``ANISO_TT_DUMP``: gradients, parameters, plugin state,
merged over the pipeline stages) and its TensorBoard scalars."""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import time
from dataclasses import dataclass

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
LAUNCHER = os.path.join(HERE, "torchtitan_launcher.py")


@dataclass
class Run:
    name: str
    folder: str
    proc: subprocess.Popen
    log: str
    dump: str
    world: int

    def result(self) -> dict:
        rc = self.proc.wait()
        with open(self.log) as f:
            out = f.read()
        if rc != 0:
            raise AssertionError(f"torchtitan run {self.name!r} failed (exit {rc}):\n{out[-6000:]}")
        record = torch.load(self.dump, weights_only=False) if os.path.exists(self.dump) else {}
        for other in sorted(glob.glob(self.dump + ".rank*")):  # the other pipeline stages' parameters
            stage = torch.load(other, weights_only=False)
            for key in ("params", "grads", "grads_step2", "final_params"):
                record.setdefault(key, {}).update(stage.get(key, {}))
            if "aniso_state" in stage:
                record["aniso_state"] = stage["aniso_state"]
        record["log"] = out
        record["tb"] = _tensorboard(self.folder)
        record["folder"] = self.folder
        return record


def _tensorboard(folder: str) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    scalars: dict[str, dict[int, float]] = {}
    for events in glob.glob(os.path.join(folder, "tb", "*")):
        acc = EventAccumulator(events)
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            scalars.setdefault(tag, {}).update({e.step: e.value for e in acc.Scalars(tag)})
    return scalars


class Launcher:
    """Runs jobs in `root/<name>`, at most `parallel` processes at once, each after the jobs it
    depends on (and after their `prepare` step)."""

    def __init__(self, root: str, assets: dict[str, str], parallel: int = 3, local: int = 4, world_local: int = 2) -> None:
        self.root, self.assets, self.parallel = root, assets, parallel
        self.local, self.world_local = local, world_local  # sequences per rank and micro-batch by default

    def command(
        self, name: str, config: str, args: list[str], world: int, local: int, data: str | None = None
    ) -> tuple[list[str], dict, str]:
        folder = os.path.join(self.root, name)
        os.makedirs(folder, exist_ok=True)
        env = dict(
            os.environ,
            PYTHONPATH=os.pathsep.join([ROOT, HERE, os.environ.get("PYTHONPATH", "")]),
            HF_DATASETS_CACHE=os.path.join(self.root, "hf_cache"),
            HF_HUB_OFFLINE="1",
            OMP_NUM_THREADS="1",
            ANISO_TT_DUMP=os.path.join(folder, "record.pt"),
        )
        env.pop("RANK", None)
        head = [sys.executable, LAUNCHER]
        if world > 1:
            head = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={world}",
                    "--rdzv_backend=c10d", "--rdzv_endpoint=localhost:0", LAUNCHER]
        cmd = head + [
            "--module", "torchtitan_launcher", "--config", config,
            "--hf_assets_path", self.assets["tokenizer"], "--dataloader.dataset_path", self.assets[data or f"data_w{world}"],
            "--dump_folder", folder, "--training.local_batch_size", str(local),
            "--checkpoint.enable", *args,
        ]  # fmt: skip
        return cmd, env, folder

    def run_all(self, jobs: list[dict]) -> dict[str, dict]:
        """`jobs`: dicts with name, config, args, and optionally world, local (batch per rank and
        micro-batch), after (names), prepare (called with the finished results before the job
        starts). Returns name -> result."""
        pending, running, done = list(jobs), {}, {}
        try:
            self._loop(pending, running, done)
        finally:
            for run in running.values():
                run.proc.kill()
        return done

    def _loop(self, pending: list[dict], running: dict[str, Run], done: dict[str, dict]) -> None:
        while pending or running:
            for name, run in list(running.items()):
                if run.proc.poll() is not None:
                    done[name] = running.pop(name).result()
            for job in list(pending):
                if not all(dep in done for dep in job.get("after", ())):
                    continue
                busy = sum(r.world for r in running.values())
                if busy and busy + job.get("world", 1) > self.parallel:
                    break
                pending.remove(job)
                if job.get("prepare"):
                    job["prepare"](done)
                world = job.get("world", 1)
                local = job.get("local", self.local if world == 1 else self.world_local)
                cmd, env, folder = self.command(job["name"], job["config"], job["args"], world, local, job.get("data"))
                log = os.path.join(folder, "out.log")
                with open(log, "w") as f:
                    proc = subprocess.Popen(cmd, cwd=folder, env=env, stdout=f, stderr=subprocess.STDOUT)
                running[job["name"]] = Run(job["name"], folder, proc, log, env["ANISO_TT_DUMP"], job.get("world", 1))
            time.sleep(0.2)


def assert_aniso_report_reads_the_last_checkpoint(run: dict, tmp_path) -> None:
    """`aniso report` (the real CLI) on a run's DCP checkpoint folder reads its newest step: the
    embedding's and the head's shapes and mean cosine equal the run's final parameters'."""
    import json

    import pytest
    from test_report import ref_mean_cosine

    p = subprocess.run([sys.executable, "-m", "aniso_plugins.offline.cli", "report", os.path.join(run["folder"], "checkpoint"),
                        "--out", str(tmp_path / "r"), "--quiet", "--no-plots", "--json"], capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr
    model = json.loads(p.stdout)["models"][0]
    steps = sorted(int(s.split("-")[1]) for s in os.listdir(os.path.join(run["folder"], "checkpoint")))
    assert model["kind"] == "dcp" and model["path"].endswith(f"step-{steps[-1]}")
    names = {"embedding": "tok_embeddings.weight", "head": "lm_head.weight"}
    assert set(model["matrices"]) == set(names)
    for role, param in names.items():
        w = run["final_params"][param].double().numpy()
        got = model["matrices"][role]
        assert (got["rows"], got["dim"]) == w.shape
        assert got["raw"]["mean_cosine"] == pytest.approx(ref_mean_cosine(w), rel=1e-6, abs=1e-9), role
