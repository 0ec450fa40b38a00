"""The HF Trainer's distributed engines on CPU, for tests only: DDP, accelerate's FSDP (1 and 2)
and DeepSpeed ZeRO-1/2/3 (with and without CPU offload) on gloo processes.

accelerate needs two shims to run FSDP and DeepSpeed on CPU at all; users on GPUs need neither
(docs/trainers.md says so):

- FSDP: accelerate drops the FSDP plugin on ``MULTI_CPU`` and silently trains DDP. The shim puts
  the plugin back (``distributed_type = FSDP``), and FSDP1 gets the device without an index
  ("Inconsistent compute device and `device_id`: cpu vs cpu:0").
- DeepSpeed: without an accelerator ``PartialState._prepare_backend`` answers ``NO``, the
  Trainer fills "auto" batch sizes for one process and DeepSpeed asserts on them; the shim
  answers gloo / ``MULTI_CPU`` under torchrun.

ZeRO-3 leaves parameters under ``stage3_param_persistence_threshold`` (1e5 elements) gathered:
a tiny model would not be partitioned at all, and a test would pass for the wrong reason. The
configurations here set it to 0."""

from __future__ import annotations

import os
from typing import Any

ENGINES = ("ddp", "fsdp1", "fsdp1_flat", "fsdp2", "fsdp2_sharded", "zero1", "zero2", "zero2_fp16", "zero3", "zero3_offload")
"""ddp; fsdp1 (``use_orig_params=True``), fsdp1_flat (``use_orig_params=False``), fsdp2, and
fsdp2_sharded (fsdp2 checkpointing ``SHARDED_STATE_DICT``: accelerate's DCP folder
``checkpoint-N/pytorch_model_fsdp_0``); DeepSpeed ZeRO stages 1, 2, 3, and 3 with parameters and
optimizer states offloaded to CPU; zero2_fp16: ZeRO-2 in fp16 with DeepSpeed's static loss scale 128."""


def install_cpu_shims() -> None:
    """Patch accelerate so that FSDP and DeepSpeed run on CPU processes (test harness only)."""
    import torch
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    if getattr(AcceleratorState.__init__, "_aniso_cpu_shim", False):
        return
    prepare_backend, init = PartialState._prepare_backend, AcceleratorState.__init__

    def gloo_under_deepspeed(self, cpu=False, sagemaker_dp=False, backend=None):
        if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true" and "LOCAL_RANK" in os.environ:
            return "gloo", DistributedType.MULTI_CPU
        return prepare_backend(self, cpu, sagemaker_dp, backend)

    def keep_fsdp_plugin(self, *args, fsdp_plugin=None, **kwargs):
        init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = DistributedType.FSDP
            self.fsdp_plugin = fsdp_plugin
            PartialState._shared_state["distributed_type"] = DistributedType.FSDP
            self.device = PartialState._shared_state["device"] = torch.device("cpu")

    keep_fsdp_plugin._aniso_cpu_shim = True
    PartialState._prepare_backend = gloo_under_deepspeed
    AcceleratorState.__init__ = keep_fsdp_plugin


def allow_deepspeed_cpu_fp16() -> None:
    """Let DeepSpeed's CPU accelerator take fp16 (test harness only). It refuses fp16 ("Type fp16
    is not supported on your device") where oneDNN has no fp16 kernels
    (``torch.ops.mkldnn._is_mkldnn_fp16_supported()`` False: CPUs without AVX512-FP16 / AMX-FP16,
    e.g. AMD EPYC), although PyTorch's CPU half-precision ops it then runs work on every CPU
    (slower). Users of fp16 train on GPUs, where the check passes."""
    from deepspeed.accelerator import get_accelerator

    accelerator = type(get_accelerator())
    if getattr(accelerator.is_fp16_supported, "_aniso_cpu_shim", False):
        return

    def supported(self) -> bool:
        return True

    def dtypes(self) -> list:
        import torch

        return [torch.float, torch.bfloat16, torch.float16]

    supported._aniso_cpu_shim = True
    accelerator.is_fp16_supported, accelerator.supported_dtypes = supported, dtypes


def deepspeed_config(stage: int, offload: bool = False) -> dict[str, Any]:
    """A DeepSpeed configuration for the Trainer ("auto" fields filled by it), fp32, with every
    parameter partitioned under ZeRO-3."""
    zero: dict[str, Any] = {"stage": stage}
    if stage == 3:
        zero |= {
            "stage3_param_persistence_threshold": 0,  # else a tiny model stays gathered
            "stage3_gather_16bit_weights_on_model_save": False,
        }
    if offload:
        zero |= {"offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}}
    return {
        "train_micro_batch_size_per_gpu": "auto",
        "train_batch_size": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,  # the Trainer's torch AdamW, as in the 1-process reference
        "zero_force_ds_cpu_optimizer": False,
        "bf16": {"enabled": False},
        "fp16": {"enabled": False},
    }


def engine_arguments(engine: str, layer_cls: str | None = None) -> dict[str, Any]:
    """``TrainingArguments`` keywords for `engine` (`ENGINES`) on gloo CPU processes; `layer_cls`:
    the decoder layer class FSDP wraps on its own (None: the model's ``_no_split_modules``)."""
    if engine not in ENGINES:
        raise ValueError(f"engine={engine!r}: expected one of {ENGINES}")
    if engine == "ddp":
        return {"use_cpu": True, "ddp_backend": "gloo"}
    if engine.startswith("fsdp"):
        fsdp_config: dict[str, Any] = {"version": 2 if engine.startswith("fsdp2") else 1}
        if not engine.startswith("fsdp2"):
            fsdp_config |= {"use_orig_params": engine == "fsdp1", "sync_module_states": False}
        if layer_cls is not None:
            fsdp_config["transformer_layer_cls_to_wrap"] = [layer_cls]
        if engine == "fsdp2_sharded":  # the Trainer's default is FULL_STATE_DICT
            fsdp_config["state_dict_type"] = "SHARDED_STATE_DICT"
        return {"use_cpu": True, "ddp_backend": "gloo", "fsdp": "full_shard", "fsdp_config": fsdp_config}
    config = deepspeed_config(int(engine[4]), offload=engine.endswith("offload"))
    if engine.endswith("fp16"):
        config["fp16"] = {"enabled": True, "loss_scale": 128}
        return {"ddp_backend": "gloo", "deepspeed": config, "fp16": True}
    return {"ddp_backend": "gloo", "deepspeed": config}


__all__ = ["ENGINES", "deepspeed_config", "engine_arguments", "install_cpu_shims"]
