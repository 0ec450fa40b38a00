#!/usr/bin/env bash
# The GPU cases of issue 16 on one CUDA device, every table printed (docs/performance.md §7.5):
#   1. head + loss at V=128256, d=4096, N in {4096, 16384, 32768}, bf16: plain, fused AGG (gates 1
#      and typical), PyTorch's F.linear_cross_entropy, Liger-Kernel FLCE, CCE Triton and CCE
#      torch_compile (a peer that is not installed is skipped with the reason);
#   2. the token counter at V=262144, 65536 targets/step, K=10000 (targets on the GPU);
#   3. one geometry measurement and one bottleneck probe at V=131072, d=4096;
#   4. host synchronisations per steady-state training step of every method through the HF Trainer
#      (host_syncs.py: the dispatch-level count and CUDA's own, set_sync_debug_mode("warn")), and the
#      session's own steady step of every method under set_sync_debug_mode("error") (strict_step.py,
#      fp32 and bf16 autocast);
#   5. with 2 GPUs or more: one HF Trainer step per engine on 2 processes over NCCL (hf_step.py --engine).
# Budget: about 8 minutes on one recent GPU, most of it the counter's 10,200 CPU-side steps per law
# and the first-call compilation of the Triton peers.
#
# Install first (a fresh GPU machine, from the repository's root; Liger-Kernel is the one peer not in an extra):
#   pip install "torch==2.14.1" -e ".[hf,bench,deepspeed]" liger-kernel
#
#   bash benchmarks/gpu.sh                  # CUDA, bf16
#   bash benchmarks/gpu.sh --device cpu     # smoke mode: the same three runs at tiny sizes on the CPU
#   PYTHON=/path/to/venv/bin/python bash benchmarks/gpu.sh   # the interpreter to run (default: python3 on PATH)
set -euo pipefail
PYTHON="${PYTHON:-python3}"
cd "$(dirname "$0")"
DEVICE=cuda
if [[ "${1:-}" == "--device" ]]; then DEVICE="${2:?--device needs cpu or cuda}"; fi
PEERS=plain,fused_ones,fused_typical,torch_lce,liger_flce,cce_triton,cce_compile
if [[ "$DEVICE" == cuda ]]; then
  HEADS=(--vocab 128256 --tokens 4096,16384,32768 --dim 4096 --rounds 5 --time-flops 1e16 --run-flops 1e16)
  COUNTER=(--counter-vocab 262144 --counter-tokens 65536 --window 10000)
  GEOMETRY=(--geometry-vocab 131072 --geometry-dim 4096 --probe-tokens 4096)
  THREADS=8
  SYNCS=()
elif [[ "$DEVICE" == cpu ]]; then
  HEADS=(--vocab 1024 --tokens 64,128 --dim 32 --rounds 1 --memory-limit-gib 4)
  COUNTER=(--counter-vocab 1000 --counter-tokens 500 --window 20)
  GEOMETRY=(--geometry-vocab 512 --geometry-dim 32 --probe-tokens 64)
  THREADS=1
  SYNCS=(--methods agg,agg_unfused,cosreg)
else
  echo "gpu.sh: --device must be cuda or cpu, got $DEVICE" >&2
  exit 2
fi
"$PYTHON" scale.py --device "$DEVICE" --dtype bf16 --threads "$THREADS" --section heads --extra-dim 0 \
  --variants "$PEERS" "${HEADS[@]}"
"$PYTHON" scale.py --device "$DEVICE" --threads "$THREADS" --section counter "${COUNTER[@]}"
"$PYTHON" scale.py --device "$DEVICE" --dtype bf16 --threads "$THREADS" --section geometry "${GEOMETRY[@]}"
"$PYTHON" host_syncs.py --device "$DEVICE" --steps 3 "${SYNCS[@]}"
"$PYTHON" strict_step.py --device "$DEVICE" --dtype fp32 "${SYNCS[@]}"
"$PYTHON" strict_step.py --device "$DEVICE" --dtype bf16 "${SYNCS[@]}"
GPUS=0
if [[ "$DEVICE" == cuda ]]; then GPUS=$("$PYTHON" -c "import torch; print(torch.cuda.device_count())"); fi
if (( GPUS >= 2 )); then
  "$PYTHON" hf_step.py --engine ddp,fsdp2,zero2,zero3 --nproc 2 --rounds 2
else
  echo "gpu.sh: $GPUS GPU(s): the 2-process NCCL engine table (hf_step.py --engine) needs 2"
fi
