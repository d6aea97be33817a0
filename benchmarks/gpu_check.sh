#!/usr/bin/env bash
# The GPU checks in one call, each output also written to OUT_DIR.
#
#   benchmarks/gpu_check.sh [OUT_DIR]          # every check (default runs/gpu-check), as results/gpu-h100/ was made
#   benchmarks/gpu_check.sh --speed [OUT_DIR]  # the training-speed check only (default runs/gpu-speed), issue 75
#   PY=python3 MODEL=/path/to/model PYTEST_ARGS="-n 8" benchmarks/gpu_check.sh out
#
# Every check: the compiled-kernel tests, then the kernel, training-step, decode, CUDA-graph ceiling and prefill
# benchmarks. About 10 minutes: the fp32 attention tests at d = 128 each take 200-215 s to compile on an H100.
# --speed: the compiled attention and capacity kernels against their PyTorch references (bf16 / fp16 / fp32, d = 64 /
# 96 / 128, packed documents, GQA, decode shapes, a gated model against its oracle), then the attention kernel against
# SDPA's flash path at T = 4k / 16k / 32k, d = 64 / 128, and one distillation step against its floor with a breakdown
# by kernel category; rows to OUT_DIR/gpu.json (benchmarks/results/gpu.json is a copy of the last run's). About 6-8
# minutes on an H200, most of it compiling and autotuning the kernels.
#
# Costs do not depend on the weights, so MODEL may be a randomly initialised copy of the model
# (benchmarks/random_copy.py) where the weights cannot be brought along; a MODEL folder is also the model of the GPU
# chat tests (RETENTION_GPU_MODEL), which otherwise need the embedded one. Without the GGUF there:
# `python -m benchmarks.random_copy smollm2-135m shape --no-weights` here (3 MB), carry `shape`, then
# `python3 -m benchmarks.random_copy shape /tmp/smol-random && MODEL=/tmp/smol-random benchmarks/gpu_check.sh` there.
set -u -o pipefail
SPEED=0
if [ "${1:-}" = "--speed" ]; then SPEED=1; shift; fi
if [ $SPEED = 1 ]; then OUT=${1:-runs/gpu-speed}; else OUT=${1:-runs/gpu-check}; fi
PY=${PY:-python}
MODEL=${MODEL:-smollm2-135m}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if [ -d "$MODEL" ]; then export RETENTION_GPU_MODEL=$MODEL; fi
$PY -c "import torch; assert torch.cuda.is_available(), 'no CUDA device: these checks need a GPU'" || exit 1
$PY -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, \
'transformers', transformers.__version__, torch.cuda.get_device_name())" | tee "$OUT/env.txt"

if [ $SPEED = 1 ]; then
  # a process of its own: interpreter-mode test modules set TRITON_INTERPRET=1 for theirs
  timeout "${TEST_TIMEOUT:-240}" $PY -m pytest -p no:cacheprovider -m gpu tests/test_gpu_kernels.py \
    -k "attention or capacity or oracle" -q ${PYTEST_ARGS:-} 2>&1 | tee "$OUT/gpu_tests.txt"
  timeout "${BENCH_TIMEOUT:-240}" $PY -m benchmarks.kernels --methods ours sdpa --seq 4096 16384 32768 --dims 64 128 \
    --json "$OUT/gpu.json" 2>&1 | tee "$OUT/bench_kernels.txt"
  timeout "${STEP_TIMEOUT:-150}" $PY -m benchmarks.train_step --model "$MODEL" --seq-len 4096 --reps 5 --dtype bfloat16 \
    --json "$OUT/gpu.json" 2>&1 | tee "$OUT/bench_train.txt"
  exit 0
fi

$PY -m pytest -p no:cacheprovider -m gpu tests/test_gpu_kernels.py tests/test_gpu_train.py -v --durations=8 ${PYTEST_ARGS:-} 2>&1 | tee "$OUT/gpu_tests.txt"
$PY -m benchmarks.kernels --seq 4096 16384 32768 --dims 64 128 2>&1 | tee "$OUT/bench_kernels.txt"
for dtype in float32 bfloat16; do
  $PY -m benchmarks.train_step --model "$MODEL" --seq-len 4096 --reps 5 --dtype $dtype 2>&1
done | tee "$OUT/bench_train.txt"
$PY -m benchmarks.decode --model "$MODEL" --contexts 2048 4096 8192 --budget 512 --new 32 --dtype bfloat16 --repeats 3 \
  --profile "$OUT/decode_profile.txt" 2>&1 \
  | tee "$OUT/bench_decode.txt"
$PY -m benchmarks.graph_ceiling --model "$MODEL" --context 4096 --budget 512 --new 32 --repeats 4 --dtype bfloat16 2>&1 \
  | tee "$OUT/bench_graph_ceiling.txt"
$PY -m benchmarks.prefill --model "$MODEL" --contexts 4096 16384 --chunk 0 --dtype bfloat16 --repeats 3 2>&1 \
  | tee "$OUT/bench_prefill.txt"
