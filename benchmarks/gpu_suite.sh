#!/usr/bin/env bash
# The GPU test suite, in one command on the device machine (CI has no GPU, so these run only
# here): every test file with CUDA paths (kernels against their references, the Triton
# backend, CUDA graphs, piecewise graphs, torch.compile, GPU sampling, LoRA, quantized
# checkpoints, CUDA IPC, the GPU model architectures, LTX-2 on CUDA).
#
# Set-up, once, on this machine (the GPU image lacks the project's serving and test
# packages; av, 35 MB, stays out: the carried tree must stay under 64 MiB):
#   ../shared/gpu/wheels.sh pytest peft 'diffusers>=0.42' pillow hypothesis jsonschema \
#       accelerate 'openai>=1.30' httpx
# Then, with the device tool, carrying .whl:
#   bash benchmarks/gpu_suite.sh [extra pytest args]
# It prints pytest's summary line last; the log goes to $OUT/gpu_suite.log.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl >/dev/null 2>&1 || [ -d /tmp/site ] || exit 1
  export PYTHONPATH=$PWD:/tmp/site
fi
python3 - <<'PY' || exit 1
import torch
assert torch.cuda.is_available(), "the GPU suite needs a GPU"
print("GPU:", torch.cuda.get_device_name(), "torch", torch.__version__)
PY
# (the CPU-only files of these folders stay out: the torch backend's batching, the int8 CPU
# kernels, the input building, the sampler's CPU rules run in CI)
FILES=(
  $(ls tests/kernels/test_*.py | grep -v test_int8_cpu)
  tests/attention/test_triton_backend.py tests/attention/test_triton_engine.py
  $(ls tests/runner/test_*.py | grep -v test_inputs) tests/lora
  tests/layers/test_gguf_cuda.py tests/loader/test_awq_gptq_checkpoints.py
  tests/models/test_gpu_architectures.py tests/sampling/test_beam_search.py
  tests/guided/test_reasoning_and_drafts.py tests/kv_cache/test_sliding_window.py
  tests/disagg/test_cuda_ipc.py tests/distributed/test_custom_allreduce.py
  tests/visual_gen/test_ltx2_gpu.py
)
set -o pipefail
timeout "${GPU_SUITE_TIMEOUT:-540}" python3 -m pytest -q -p no:cacheprovider "${FILES[@]}" "$@" \
  2>&1 | tee "$OUT/gpu_suite.log" | tail -n 40
