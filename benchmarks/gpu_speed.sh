#!/usr/bin/env bash
# The training-speed check on a GPU in one call (issue 75): the compiled attention and capacity kernels against their
# PyTorch references (bf16 / fp16 / fp32, d = 64 / 96 / 128, packed documents, GQA, decode shapes, a gated model
# against its oracle), then the attention kernel against SDPA's flash path at T = 4k / 16k / 32k, d = 64 / 128, and one
# distillation step against its floor with a breakdown by kernel category. Rows go to OUT_DIR/gpu.json
# (benchmarks/results/gpu.json is a copy of the last run's), tables to OUT_DIR/*.txt.
#
#   benchmarks/gpu_speed.sh [OUT_DIR]              # MODEL=/path/to/model for the step (default: the embedded model)
#
# Costs do not depend on the weights, so MODEL may be a random-weight copy (benchmarks/random_copy.py). About 6-8
# minutes on an H200, most of it compiling and autotuning the kernels.
set -u -o pipefail
OUT=${1:-runs/gpu-speed}
PY=${PY:-python}
MODEL=${MODEL:-smollm2-135m}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
$PY -c "import torch; assert torch.cuda.is_available(), 'no CUDA device: these checks need a GPU'" || exit 1
$PY -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, \
'transformers', transformers.__version__, torch.cuda.get_device_name())" | tee "$OUT/env.txt"
# a process of its own: interpreter-mode test modules set TRITON_INTERPRET=1 for theirs
timeout "${TEST_TIMEOUT:-240}" $PY -m pytest -p no:cacheprovider -m gpu tests/test_gpu_kernels.py \
  -k "attention or capacity or oracle" -q ${PYTEST_ARGS:-} 2>&1 | tee "$OUT/gpu_tests.txt"
timeout "${BENCH_TIMEOUT:-240}" $PY -m benchmarks.kernels --methods ours sdpa --seq 4096 16384 32768 --dims 64 128 \
  --json "$OUT/gpu.json" 2>&1 | tee "$OUT/bench_kernels.txt"
timeout "${STEP_TIMEOUT:-150}" $PY -m benchmarks.train_step --model "$MODEL" --seq-len 4096 --reps 5 --dtype bfloat16 \
  --json "$OUT/gpu.json" 2>&1 | tee "$OUT/bench_train.txt"
