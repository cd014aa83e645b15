#!/usr/bin/env bash
# The GPU test suite, in one command on the device machine (CI has no GPU, so these run only
# here): every test file with CUDA paths (kernels against their references, the Triton
# backend, CUDA graphs, piecewise graphs, torch.compile, GPU sampling, LoRA, quantized
# checkpoints, CUDA IPC, the GPU model architectures, LTX-2 on CUDA).
#
# Set-up, once, on this machine (the GPU image lacks the project's serving and test
# packages; av, 35 MB, stays out: the carried tree must stay under 64 MiB):
#   ../shared/gpu/wheels.sh pytest peft 'diffusers>=0.42' pillow hypothesis jsonschema \
#       accelerate 'openai>=1.30' httpx compressed-tensors sentence-transformers pytest-xdist \
#       'grpcio>=1.85.1' 'protobuf>=7.35.1'
#   rm -f .whl/scipy-* .whl/scikit_learn-* .whl/av-*   (the image has scipy and scikit-learn)
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
# kernels, the input building, the sampler's CPU rules run in CI). The round-3 parity files
# below build LLM(...) without a device, so on this machine they run the CUDA path (Triton
# attention, CUDA graphs) against HF on the CPU: MLA, Mamba-2 state, sinks, MXFP4, chunked
# attention, VLM encoders, pooling (non-causal attention), the deterministic mode.
FILES=(
  $(ls tests/kernels/test_*.py | grep -v test_int8_cpu)
  tests/attention/test_triton_backend.py tests/attention/test_triton_engine.py
  tests/attention/test_attention_sinks_backends.py tests/attention/test_non_causal.py
  tests/attention/test_batch_invariant_attention.py tests/attention/test_chunked_attention.py
  $(ls tests/runner/test_*.py | grep -v -e test_inputs -e test_kv_cache_budget) tests/lora
  tests/layers/test_gguf_cuda.py tests/layers/test_batch_invariant.py tests/layers/test_rotary.py
  tests/layers/test_mamba2_mixer.py tests/layers/test_grouped_topk.py tests/layers/test_moe_layer.py
  tests/loader/test_awq_gptq_checkpoints.py
  tests/models/test_gpu_architectures.py tests/models/test_deepseek_parity.py
  tests/models/test_nemotron_h_parity.py tests/models/test_granite_hybrid_parity.py
  tests/models/test_hybrid_prefix_reuse.py tests/models/test_gpt_oss_parity.py
  tests/models/test_hybrid_state_dtype.py
  tests/models/test_llama4_parity.py tests/models/test_moe_parity.py
  tests/models/test_qwen3_next_parity.py tests/layers/test_gated_deltanet.py
  tests/layers/test_fp8_moe.py tests/models/test_fp8_moe_models.py tests/layers/test_moe_load.py
  tests/multimodal tests/pooling/test_pooling_models.py tests/pooling/test_pooling_api.py
  tests/llmapi/test_deterministic.py
  $(ls tests/speculative/test_*.py | grep -v test_spec_smollm2)  # (SmolLM2 is not carried)
  tests/sampling/test_beam_search.py
  tests/guided/test_reasoning_and_drafts.py tests/kv_cache/test_sliding_window.py
  tests/visual_gen/test_ltx2_gpu.py tests/visual_gen/test_flux.py tests/visual_gen/test_wan.py
  tests/visual_gen/test_visual_fp8.py
)
# These measure free GPU memory or start processes of their own: alone, after the rest.
SERIAL=(
  tests/runner/test_kv_cache_budget.py tests/llmapi/test_rollout.py
  tests/disagg/test_cuda_ipc.py tests/distributed/test_custom_allreduce.py
)
# pytest-xdist (when the wheels have it): Triton's compiles are CPU work, so workers on the
# host's cores share the one GPU; a file stays on one worker (module fixtures, graphs).
PARALLEL=()
python3 -c "import xdist" 2>/dev/null && PARALLEL=(-n "${GPU_SUITE_WORKERS:-8}" --dist loadfile)
set -o pipefail
LIMIT=${GPU_SUITE_TIMEOUT:-540}
start=$(date +%s)
timeout "$((LIMIT - 90))" python3 -m pytest -q -p no:cacheprovider "${PARALLEL[@]}" \
  --durations=15 "${FILES[@]}" "$@" 2>&1 | tee "$OUT/gpu_suite.log" | tail -n 60
left=$((LIMIT - ($(date +%s) - start)))
timeout "$((left > 30 ? left : 30))" python3 -m pytest -q -p no:cacheprovider "${SERIAL[@]}" \
  "$@" 2>&1 | tee "$OUT/gpu_suite_serial.log" | tail -n 25
echo "summary: $(grep -E '(passed|failed|error)' "$OUT/gpu_suite.log" | tail -n 1)" \
  "+ serial: $(grep -E '(passed|failed|error)' "$OUT/gpu_suite_serial.log" | tail -n 1)"
