#!/usr/bin/env bash
# For a session lent a CUDA machine: connmon's correctness on the GPU (benchmarks/cuda_check.py) and the benchmarks
# with --device cuda, in one file of tables ($OUT/gpu_figures.md when the device tool's $OUT is set, else
# benchmarks/gpu_figures.md). About 8 minutes on an H200; record the figures in benchmarks/README.md.
#
# The machine has no network: it uses the Python that holds PyTorch there (with lightning, torchmetrics,
# transformers, scipy, matplotlib, pytest) and connmon from this checkout on PYTHONPATH; W&B is not needed for these runs.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-benchmarks}/gpu_figures.md"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
status=0
{
  echo "# connmon on the GPU ($(date -u +%Y-%m-%d))"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  echo
  echo "## Correctness: benchmarks/cuda_check.py --device cuda"
  timeout 300 python3 benchmarks/cuda_check.py --device cuda || status=1  # the curvature on flash and bf16 too
  echo
  echo "## bench_functional.py --device cuda --quick"
  timeout 180 python3 benchmarks/bench_functional.py --device cuda --quick || status=1
  echo "## bench_functional.py --device cuda --full-sample --repeats 1 (GPT-2-small shape)"
  timeout 90 python3 benchmarks/bench_functional.py --device cuda --full-sample --repeats 1 || status=1
  echo
  echo "## bench_sample.py --device cuda (each part of a full sample, in training steps of the example)"
  timeout 120 python3 benchmarks/bench_sample.py --device cuda || status=1
  echo
  echo "## flex_attention trained with the capture armed (no flex backward on CPU): tests/capture/test_code_bases.py"
  timeout 120 python3 -m pytest -q -p no:cacheprovider tests/capture/test_code_bases.py -k "cuda or flex" || status=1
  echo
  echo "## Lightning FSDPStrategy (FSDP1 needs CUDA): logged values equal one process's (tests/callbacks/test_ddp.py)"
  timeout 90 python3 -m pytest -q -p no:cacheprovider tests/callbacks/test_ddp.py -k "fsdp and not fsdp2" || status=1
  echo
  echo "## The sharded curvature on a one-rank FSDP2 mesh with NCCL (tests/integrations/test_sharded_curvature.py)"
  timeout 90 python3 -m pytest -q -p no:cacheprovider tests/integrations/test_sharded_curvature.py -k "one_rank" || status=1
  echo
  echo "## OLMo-core on CUDA: SDPA read exactly, flash-attn skipped with one line (tests/integrations/test_olmo_core.py)"
  if python3 -c "import olmo_core" 2>/dev/null; then
    timeout 120 python3 -m pytest -q -p no:cacheprovider -m olmo_core tests/integrations/test_olmo_core.py \
      -k "each_attention_backend" -rs || status=1
  else
    echo "olmo-core is not installed here (pip install -e '.[olmo-core]' in an environment of its own): not run"
  fi
  echo
  echo "## bench_capture.py --device cuda --no-memory (memory tables are CPU resident memory: not run here)"
  timeout 120 python3 benchmarks/bench_capture.py --device cuda --no-memory || status=1
} 2>&1 | tee "$out"
exit "$status"
