"""Run torchtitan's real ``Trainer`` on CPU, for the tests and the CPU benchmark.

    python tests/torchtitan_launcher.py --module M --config F [flags]               # 1 process
    torchrun --nproc_per_node 2 tests/torchtitan_launcher.py --module M --config F  # 2 ranks

torchtitan 0.3.0 has no CPU path; before ``torchtitan.train.main``
this launcher applies the patches that make it run:

1. device: ``device_type = "cpu"`` and a small stand-in for ``torch.cuda`` in the modules that
   imported them (set_device, memory statistics, synchronize, ...);
2. gloo has no ``ReduceOp.PREMUL_SUM``: FSDP2 modules are told to reduce-scatter with SUM
   (``set_force_sum_reduction_for_comms``); torchtitan already sets the gradient divide factor
   to 1, so the gradients are unchanged;
3. attention: FlexAttention has no CPU backward, so the test recipes in this module swap in
   SDPA (plain causal attention; every test document is exactly one sample, so the document
   mask would change nothing);
4. expert parallelism: gloo's list ``all_to_all`` needs equal chunks; the token dispatcher's
   uneven ones go through ``all_to_all_single`` with split sizes.

The test recipes (`cpu_stock`, `cpu_aniso`) shrink llama3's debug model (2 layers) for speed;
`cpu_aniso_6_layers` keeps its 6 layers (benchmarks/torchtitan_step.py).
With ``ANISO_TT_DUMP=<file>`` the launcher also records, for the tests, the step-1 gradients,
parameters, LM-head inputs and labels (before the optimizer step), the step-2 gradients and, after training, the
final parameters and the aniso plugin state, and the host reads of step 3 (``torch.save`` of plain
tensors, rank 0; under pipeline parallelism the first rank of every other stage writes its
stage's to ``<file>.rank<r>``).
With ``ANISO_TT_PEAK=<file>`` each rank writes its peak resident set size (KiB) to ``<file>.rank<r>``.
"""

from __future__ import annotations

import os
import socket
import sys
from types import SimpleNamespace

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
N_LAYERS = 2


# --- 1. device and gloo patches -----------------------------------------------------------------
class _CPUDevice:
    """What torchtitan calls on ``torch.cuda``, answered for the CPU."""

    @staticmethod
    def set_device(device) -> None:
        pass

    @staticmethod
    def current_device() -> int:
        return 0

    @staticmethod
    def device_count() -> int:
        return 1

    @staticmethod
    def get_device_name(device=None) -> str:
        return "CPU"

    @staticmethod
    def get_device_properties(device=None):
        return SimpleNamespace(total_memory=64 * 1024**3)

    @staticmethod
    def memory_stats(device=None) -> dict:
        return {}

    @staticmethod
    def reset_peak_memory_stats(device=None) -> None:
        pass

    @staticmethod
    def empty_cache() -> None:
        pass

    @staticmethod
    def synchronize(device=None) -> None:
        pass


def patch_torchtitan_for_cpu() -> None:
    """Apply patches 1 and 2 (see the module docstring). Idempotent."""
    import importlib

    import torchtitan.distributed.fsdp as tt_fsdp
    from torch.distributed.fsdp import FSDPModule

    for name in (
        "torchtitan.tools.utils",
        "torchtitan.distributed.utils",
        "torchtitan.distributed.parallel_dims",
        "torchtitan.components.metrics",
        "torchtitan.tools.profiler",
        "torchtitan.models.common.token_dispatcher",
    ):
        module = importlib.import_module(name)
        if hasattr(module, "device_type"):
            module.device_type = "cpu"
        if hasattr(module, "device_module"):
            module.device_module = _CPUDevice
    _all_to_all_through_splits()
    if getattr(tt_fsdp.disable_fsdp_gradient_division, "_sum_for_gloo", False):
        return
    original = tt_fsdp.disable_fsdp_gradient_division

    def disable_division_and_premul_sum(model: torch.nn.Module) -> None:
        original(model)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)

    disable_division_and_premul_sum._sum_for_gloo = True
    tt_fsdp.disable_fsdp_gradient_division = disable_division_and_premul_sum


def _all_to_all_through_splits() -> None:
    """Patch 4 (expert parallelism): gloo's list ``all_to_all`` needs equal chunks, but the
    token dispatcher sends each rank the tokens routed to its experts (uneven); route it through
    ``all_to_all_single`` with split sizes, which gloo supports. Same values. Idempotent."""
    import torch.distributed as dist

    if getattr(dist.all_to_all, "_through_splits", False):
        return
    original = dist.all_to_all

    def all_to_all(output_tensor_list, input_tensor_list, group=None, async_op=False):
        if async_op or len({t.shape[1:] for t in [*input_tensor_list, *output_tensor_list]}) != 1:
            return original(output_tensor_list, input_tensor_list, group=group, async_op=async_op)
        out = torch.cat(output_tensor_list)
        dist.all_to_all_single(out, torch.cat(input_tensor_list), [t.shape[0] for t in output_tensor_list],
                               [t.shape[0] for t in input_tensor_list], group=group)
        for target, piece in zip(output_tensor_list, out.split([t.shape[0] for t in output_tensor_list])):
            target.copy_(piece)
        return None

    all_to_all._through_splits = True
    dist.all_to_all = all_to_all


# --- 3. test recipes -----------------------------------------------------------------------------
def _cpu(config, n_layers: int = N_LAYERS):
    """Shrink a llama3 debug recipe for CPU tests: SDPA attention, `n_layers` layers, short
    sequences, float32, no gradient clipping, activation checkpointing, compile or CUDA graphs;
    TensorBoard on; validation off (one batch when enabled). Data and tokenizer paths come
    from flags (``--hf_assets_path``, ``--dataloader.dataset_path``,
    ``--validator.dataloader.dataset_path``)."""
    from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader
    from torchtitan.models.common.attention import ScaledDotProductAttention

    model = config.model_spec.model
    model.layers = model.layers[:n_layers]
    for layer in model.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    config.training.seq_len = 32
    config.training.local_batch_size = 2
    config.training.steps = 4
    config.training.disable_cuda_graphs = True
    config.training.mixed_precision_param = "float32"
    config.training.max_norm = 1e6  # no clipping: the tests compare the raw step-1 gradients
    config.activation_checkpoint = None
    config.compile.enable = False
    config.validator.enable = False  # tests enable it with --validator.enable
    config.validator.steps = 1
    config.validator.dataloader = HuggingFaceTextDataLoader.Config(dataset="c4_test", infinite=False)
    config.metrics.log_freq = 1
    config.metrics.enable_tensorboard = True
    config.lr_scheduler.warmup_steps = 1
    config.checkpoint.interval = 2
    config.checkpoint.keep_latest_k = 0
    config.debug.seed = 0
    return config


def cpu_stock():
    """torchtitan's own ``llama3_debugmodel`` (stock Trainer), shrunk for CPU."""
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    return _cpu(llama3_debugmodel())


def cpu_aniso():
    """aniso_plugins' ``llama3_debugmodel_aniso`` recipe (AnisoTrainer), shrunk the same way."""
    from aniso_plugins.integrations.torchtitan import llama3_debugmodel_aniso

    return _cpu(llama3_debugmodel_aniso())


def cpu_moe_stock():
    """torchtitan's ``qwen3_moe_debug`` (a small Qwen3 mixture of experts, stock Trainer), shrunk for CPU."""
    from torchtitan.models.qwen3.config_registry import qwen3_moe_debug

    return _cpu(qwen3_moe_debug())


def cpu_moe_aniso():
    """`cpu_moe_stock` as an aniso recipe (`aniso_trainer_config`)."""
    from aniso_plugins.integrations.torchtitan import aniso_trainer_config
    from torchtitan.models.qwen3.config_registry import qwen3_moe_debug

    return _cpu(aniso_trainer_config(qwen3_moe_debug()))


def cpu_aniso_6_layers():
    """`cpu_aniso` with all 6 layers of the debug model (benchmarks/torchtitan_step.py)."""
    from aniso_plugins.integrations.torchtitan import llama3_debugmodel_aniso

    return _cpu(llama3_debugmodel_aniso(), n_layers=6)


# --- test recording (ANISO_TT_DUMP) --------------------------------------------------------------
def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu().clone()


def _install_recorder(path: str) -> None:
    """Record the step-1 gradients etc. and the final state into `path` (see module docstring)."""
    import torch.distributed as dist
    from torchtitan.trainer import Trainer

    record: dict = {"labels": [], "head_inputs": [], "positions": []}
    train, forward_backward_step = Trainer.train, Trainer.forward_backward_step

    def recording_forward_backward_step(self, *, input_dict, labels, global_valid_tokens):
        if self.step == 1:  # pipeline parallel: lists of the pipeline micro-batches
            for y, inputs in zip(*((labels, input_dict) if isinstance(labels, list) else ([labels], [input_dict]))):
                record["labels"].append(y.detach().cpu().clone())
                if "positions" in inputs:
                    record["positions"].append(inputs["positions"].detach().cpu().clone())
        return forward_backward_step(
            self, input_dict=input_dict, labels=labels, global_valid_tokens=global_valid_tokens
        )

    def recording_train(self):
        parts = self.model_parts

        def named():
            return [item for part in parts for item in part.named_parameters()]

        def head_input(module, args):
            if self.step == 1 and module.training:
                record["head_inputs"].append(args[0].detach().cpu().clone())

        def before_step(optimizer, args, kwargs):
            if self.step == 1:
                record["params"] = {n: _full(p) for n, p in named()}
            if self.step in (1, 2):
                key = "grads" if self.step == 1 else "grads_step2"
                record[key] = {n: _full(p.grad) for n, p in named() if p.grad is not None}

        for part in parts:
            if getattr(part, "lm_head", None) is not None:
                part.lm_head.register_forward_pre_hook(head_input)
        self.optimizers.register_step_pre_hook(before_step)
        _count_host_syncs(self, record)
        train(self)
        record["final_params"] = {n: _full(p) for n, p in named()}
        runtime = getattr(self.loss_fn, "runtime", None)
        if runtime is not None:
            record["aniso_state"] = runtime.session.plugins.state_dict()
        rank = dist.get_rank() if dist.is_initialized() else 0
        pp = self.parallel_dims.pp
        if rank == 0:
            torch.save(record, path)
        elif pp > 1 and rank % (dist.get_world_size() // pp) == 0:  # the first rank of another pipeline stage
            torch.save(record, f"{path}.rank{rank}")

    Trainer.train = recording_train
    Trainer.forward_backward_step = recording_forward_backward_step


def _count_host_syncs(trainer, record: dict) -> None:
    """The host reads of step 3 (forward, backward, optimizer step, the aniso wrappers around them:
    tests/device_discipline.py's HostSyncs), by kind and by line of aniso_plugins, into `record`
    (``host_syncs``, ``host_sync_sites``)."""
    from device_discipline import HostSyncs

    train_step = trainer.train_step  # the aniso runtime's wrapper on the instance, where it has one

    def counting_train_step(data_iterator):
        if trainer.step != 3:
            return train_step(data_iterator)
        with HostSyncs(where=True) as syncs:
            out = train_step(data_iterator)
        record["host_syncs"], record["host_sync_sites"] = dict(syncs.counts), dict(syncs.sites)
        return out

    trainer.train_step = counting_train_step


# --- entry point -----------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> None:
    """Patch, then run ``torchtitan.train.main`` with `argv` (default: sys.argv[1:])."""
    if "RANK" not in os.environ:  # plain `python launcher.py`: a 1-rank process group
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    if HERE not in sys.path:  # `--module torchtitan_launcher` finds the test recipes
        sys.path.insert(0, HERE)
    patch_torchtitan_for_cpu()
    if os.environ.get("ANISO_TT_DUMP"):
        _install_recorder(os.environ["ANISO_TT_DUMP"])
    import torchtitan.train

    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    torchtitan.train.main()
    if os.environ.get("ANISO_TT_PEAK"):  # the benchmark's peak memory per rank: the process's peak RSS
        with open("/proc/self/status") as f:
            peak = next(line.split()[1] for line in f if line.startswith("VmHWM:"))
        with open(f"{os.environ['ANISO_TT_PEAK']}.rank{os.environ.get('RANK', '0')}", "w") as f:
            f.write(peak)


if __name__ == "__main__":
    main()
