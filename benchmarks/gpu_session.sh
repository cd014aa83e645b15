#!/usr/bin/env bash
# The H200 runs of 2026-12-01's round-2 issues, in sections that each fit one device call
# (10 minutes at most). Run from the repository root on the GPU machine, with .whl carried:
#   bash benchmarks/gpu_session.sh quant    # GPU tests of the new kernels, INT4, GGUF
#   bash benchmarks/gpu_session.sh serving  # LoRA, beam search, disaggregated KV transfer
#   bash benchmarks/gpu_session.sh spec     # verify graphs: tests, verify cost, replay speed-up
#   bash benchmarks/gpu_session.sh kernels  # INT4 and LoRA again after tuning
#   bash benchmarks/gpu_session.sh smollm2  # n-gram speculation and guided JSON on SmolLM2, GGUF
#   bash benchmarks/gpu_session.sh window   # spec replay, guided (carry .smol/tok), LoRA, INT4
#   bash benchmarks/gpu_session.sh round3   # issues 36, 35: embeddings/s; sleep, wake, update
#   bash benchmarks/gpu_session.sh round3_vlm  # issue 34: Qwen2.5-VL-7B TTFT vs HF (own call)
#   bash benchmarks/gpu_session.sh verify  # the GPU suite, DeepSeek's graphs, issue 33 (one call)
#   bash benchmarks/gpu_session.sh fp8moe  # FP8 experts: capture diagnosis and GPU tests
#   bash benchmarks/gpu_session.sh models37  # GPT-OSS, Nemotron-H, Mixtral FP8, Qwen3-30B-A3B
#   bash benchmarks/gpu_session.sh next    # issues 35, 36, 39 (NEXT_CALL=1, then 2)
#   bash benchmarks/gpu_session.sh next     # issues 35, 36: deterministic mode; pooling budgets
#   NEXT_CALL=2 bash benchmarks/gpu_session.sh next  # issue 39: TeaCache, FP8 (second call)
#   bash benchmarks/gpu_session.sh round4       # the GPU suite, FP8 experts' capture, MTP
#   bash benchmarks/gpu_session.sh models_h200  # issues 33 and 37's models (an H200 call)
#   bash benchmarks/gpu_session.sh visual39     # issue 39: FLUX.1 / Wan 2.2, TeaCache, FP8
#   bash benchmarks/gpu_session.sh round5       # the GPU suite, MTP (2026-12-06, sixth)
#   bash benchmarks/gpu_session.sh models33     # issue 33's models (an H200 call)
#   bash benchmarks/gpu_session.sh models37b    # issue 37's models (an H200 call)
#   bash benchmarks/gpu_session.sh today6       # the day's GPU tests, Nemotron-H-8B (short)
#   bash benchmarks/gpu_session.sh today7       # the day's GPU tests, MTP, MXFP4 (one call)
#   bash benchmarks/gpu_session.sh suite7       # the whole GPU suite, ~560 s (one call)
#   bash benchmarks/gpu_session.sh tune8        # call 1: GEMV + FP8 sweeps, MTP, MoE decode paths
#   bash benchmarks/gpu_session.sh models8      # call 2 (warm): issue 33/37 models on the tables
#   bash benchmarks/gpu_session.sh after37      # GPT-OSS's profile, FP8 sweep applied, issue 33's models again
#   bash benchmarks/gpu_session.sh models37c    # issue 37's models at 12 layers (one H100)
#   bash benchmarks/gpu_session.sh models37d    # issue 37's two missing models + GPT-OSS's profile
# (round3 and round3_vlm import tests/ and sentence-transformers: build .whl with
#  ../shared/gpu/wheels.sh pytest sentence-transformers pillow)
# Each step has its own time limit so that one slow step cannot eat the call; output goes to
# $OUT/<step>.log (and each script's JSON to $OUT).
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl >/dev/null 2>&1 || [ -d /tmp/site ] || exit 1
export PYTHONPATH=$PWD:/tmp/site
step() {  # step NAME SECONDS COMMAND...
  local name=$1 limit=$2; shift 2
  echo "=== $name (limit ${limit}s) $(date +%T)"
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  echo "=== $name rc=$? $(date +%T)"
  tail -n 40 "$OUT/$name.log"
}
for section in "$@"; do
case $section in
  quant)
    step gpu_tests 170 python3 -m pytest -q -m "not slow" -p no:cacheprovider \
      tests/kernels/test_w4a16_gemm.py tests/loader/test_awq_gptq_checkpoints.py \
      tests/kernels/test_gguf_gemm.py tests/layers/test_gguf_cuda.py \
      tests/lora
    step gpu_int4 200 python3 benchmarks/gpu_int4.py --budget 180
    step gpu_gguf 150 python3 benchmarks/gpu_gguf.py --budget 130
    ;;
  serving)
    step gpu_tests2 80 python3 -m pytest -q -p no:cacheprovider tests/disagg/test_cuda_ipc.py \
      tests/sampling/test_beam_search.py -k "gpu or cuda or ipc"
    step gpu_lora 180 python3 benchmarks/gpu_lora.py --repeats 1
    step gpu_beam 110 python3 benchmarks/gpu_beam.py --repeats 1
    step gpu_disagg 200 python3 benchmarks/gpu_disagg.py --out "$OUT"
    ;;
  spec)
    export PYTHONUNBUFFERED=1
    step spec_replay_bf16 150 python3 benchmarks/gpu_spec_replay.py --planted \
      --corrupt 0,0.245,0.4 --profile
    [ "${SPEC_TESTS:-0}" = 1 ] && step spec_tests 70 python3 -m pytest -q -x \
      -p no:cacheprovider tests/runner/test_verify_graphs.py \
      tests/kernels/test_decode_attention.py -k "verify or eight or several or large_on_gpu"
    ;;
  kernels)  # run right after spec, in the same call: bash gpu_session.sh spec kernels
    step gpu_int4 120 python3 benchmarks/gpu_int4.py --budget 110
    step gpu_lora 200 python3 benchmarks/gpu_lora.py
    ;;
  smollm2)  # the GGUF comes in two carried halves (it is over the carry limit)
    cat /tmp/smol_a .smol/b/part >/tmp/smollm2.gguf
    echo "a1231443440b107ff29f02bdb38c9d0a  /tmp/smollm2.gguf" | md5sum -c || exit 1
    step spec_ngram 120 python3 benchmarks/cpu_speculative.py --model /tmp/smollm2.gguf \
      --repeats 3 --json "$OUT/spec_ngram.json"
    [ "${GUIDED:-0}" = 1 ] && step guided 80 python3 benchmarks/guided_decoding.py --model /tmp/smollm2.gguf \
      --repeats 2 --out "$OUT"
    step gguf_tests 60 python3 -m pytest -q -p no:cacheprovider \
      tests/kernels/test_gguf_gemm.py tests/layers/test_gguf_cuda.py
    step gpu_gguf 100 python3 benchmarks/gpu_gguf.py --budget 90
    ;;
  window)  # 2026-12-02's one call (790 s of device time left): speculation, guided, LoRA, INT4
    export PYTHONUNBUFFERED=1
    step spec_replay_bf16 140 python3 benchmarks/gpu_spec_replay.py --planted \
      --corrupt 0,0.245,0.4 --profile
    step guided 110 python3 benchmarks/guided_decoding.py --model dummy:llama-3.1-8b \
      --tokenizer .smol/tok --repeats 2 --out "$OUT"
    step gpu_lora 150 python3 benchmarks/gpu_lora.py --repeats 1
    step gpu_int4 95 python3 benchmarks/gpu_int4.py --budget 80
    ;;
  video_serve)  # issue 24's Cosmos 3 at its default size; issue 21's server at 40 req/s
    export PYTHONUNBUFFERED=1
    step cosmos 330 python3 benchmarks/gpu_video.py --out "$OUT/cosmos.json"
    step serving40 200 python3 benchmarks/gpu_serving.py --modes engine-process --rates 40,40 \
      --clients 4 --num-prompts 800 --out "$OUT/serving40.json"
    ;;
  load)  # issue 21: max load under the prefill budgets; GPU tests of the eager warm-up
    export PYTHONUNBUFFERED=1
    step graph_tests 80 python3 -m pytest -q -p no:cacheprovider tests/runner \
      tests/kernels/test_context_attention.py -k "cuda or gpu or graph"
    step load 420 python3 benchmarks/gpu_latency.py --parts floor,load --budgets 512 \
      --prefill-budgets 512,1024,2048
    ;;
  gemv)  # issue 21: GPU tests, the dense GEMV sweep, batch-1 latency with and without it
    export PYTHONUNBUFFERED=1
    step gpu_tests3 110 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_dense_gemv.py \
      tests/attention/test_triton_backend.py tests/runner -k "not cpu"
    step gpu_gemv 140 python3 benchmarks/gpu_gemv.py --budget 110 \
      --write-table "$OUT/dense_gemv_NVIDIA_H200.json" --json "$OUT/gpu_gemv.json"
    mkdir -p "$OUT/cublas" "$OUT/gemv"
    step latency_cublas 170 env OUT="$OUT/cublas" TLLM_DENSE_GEMV=0 \
      python3 benchmarks/gpu_latency.py --parts floor,latency,plain
    step latency_gemv 90 env OUT="$OUT/gemv" \
      TLLM_DENSE_GEMV_CONFIGS="$OUT/dense_gemv_NVIDIA_H200.json" \
      python3 benchmarks/gpu_latency.py --parts latency
    ;;
  after)  # issue 21 after the GEMV table and the mixed-step attention: load, server, tests
    export PYTHONUNBUFFERED=1
    step load2 150 python3 benchmarks/gpu_latency.py --parts load --budgets "" \
      --prefill-budgets 1024
    step serving40b 130 env TLLM_LOG_TRITON_COMPILES=1 python3 benchmarks/gpu_serving.py \
      --modes engine-process --rates 40,40 --clients 4 --num-prompts 800 \
      --out "$OUT/serving40b.json"
    step serving2 100 python3 benchmarks/gpu_serving.py --modes engine-process --rates 2 \
      --isl 467 --osl 256 --max-seq-len 1024 --num-prompts 40 --out "$OUT/serving2.json"
    step gemv_tests 60 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_dense_gemv.py
    ;;
  stalls)  # issue 21: the first run's TTFT tail, with slow iterations and compiles logged
    export PYTHONUNBUFFERED=1 TLLM_LOG_SLOW_STEPS_MS=100 TLLM_LOG_TRITON_COMPILES=$OUT/compiles.log
    step stall2 90 python3 benchmarks/gpu_serving.py --modes engine-process --rates 2 \
      --isl 467 --osl 256 --max-seq-len 1024 --num-prompts 40 --out "$OUT/stall2.json"
    step stall40 100 python3 benchmarks/gpu_serving.py --modes engine-process --rates 40 \
      --clients 4 --num-prompts 800 --out "$OUT/stall40.json"
    grep -h "slow executor\|triton compiled" "$OUT"/*.log "$OUT"/*/*.log 2>/dev/null | cut -c1-260 | head -60
    ;;
  suite)  # issue 32: the GPU test suite (its own call: it takes most of one)
    GPU_SUITE_TIMEOUT=560 bash benchmarks/gpu_suite.sh ;;
  scale)  # issue 32: max load, decode TPOT, host time and GPU idle per step, GEMM floors
    export PYTHONUNBUFFERED=1
    step scale 570 python3 benchmarks/gpu_scale.py --parts fp8,bf16,gemm ;;
  round3)  # issue 36's pooling and issue 35's rollout figures (about 8 minutes)
    export PYTHONUNBUFFERED=1
    step gpu_pooling 270 python3 benchmarks/gpu_pooling.py --budget 200
    step gpu_rollout 240 python3 benchmarks/gpu_rollout.py
    ;;
  round3_vlm)  # issue 34: builds and saves a 16 GiB checkpoint first; its own call
    export PYTHONUNBUFFERED=1
    step gpu_vlm 540 python3 benchmarks/gpu_vlm.py
    ;;
  verify)  # first call of the next session: the GPU suite (its fixes of 2026-12-06 never ran
    # there: rope tables under piecewise capture for DeepSeek's MLA, GPT-OSS/Granite tests on
    # older transformers), DeepSeek CPU = CUDA eager = CUDA graphs, then issue 33's figures
    export PYTHONUNBUFFERED=1
    GPU_SUITE_TIMEOUT=390 bash benchmarks/gpu_suite.sh
    step diag_deepseek 50 python3 benchmarks/gpu_diag_layers.py DeepseekV2,DeepseekV3
    step gpu_deepseek 110 python3 benchmarks/gpu_deepseek.py --budget 100
    ;;
  next)  # what issues 35, 36 and 39 still lack, by value, in two calls of ~560 s each
    # (carry .whl built with ../shared/gpu/wheels.sh pytest sentence-transformers pillow):
    #   call 1 (default): deterministic mode bitwise over random compositions and its cost,
    #     on vs off (35); embeddings at larger step budgets and one step profiled (36)
    #   call 2 (NEXT_CALL=2): FLUX.1-dev / Wan 2.2 5B with TeaCache and FP8, speed-up and
    #     PSNR against our uncached BF16 (39); then ours vs diffusers again on this card
    export PYTHONUNBUFFERED=1
    if [ "${NEXT_CALL:-1}" = 1 ]; then  # (pooling ran at 10:05 today: gpu_pooling2.log)
      step gpu_deterministic 330 python3 benchmarks/gpu_deterministic.py --budget 290 \
        --load-limit 60
      step gated_delta 50 python3 benchmarks/gpu_gated_delta.py --out "$OUT/gated_delta.json"
      step delta_tests 60 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_gated_delta.py \
        tests/models/test_qwen3_next_parity.py
    else  # issue 39's options (issue 37's models: the models37 section)
      step flux_wan_opts 280 python3 benchmarks/gpu_flux_wan.py --parts teacache,fp8 \
        --out "$OUT/flux_wan_opts.json"
      step flux_wan 240 python3 benchmarks/gpu_flux_wan.py --parts step,pipeline \
        --out "$OUT/flux_wan.json"
    fi
    ;;
  fp8moe)  # the FP8 experts' fixes of 2026-12-06 (K >= 32 blocks, GPU tolerance), capture
    export PYTHONUNBUFFERED=1
    step diag_fp8_moe 40 python3 benchmarks/gpu_diag_fp8_moe.py
    step fp8_moe_tests 90 python3 -m pytest -q --tb=short -rf -p no:cacheprovider -n 8 \
      --dist loadfile tests/kernels/test_fp8_moe_kernel.py tests/layers/test_fp8_moe.py \
      tests/models/test_fp8_moe_models.py tests/kernels/test_invariant_attention.py
    grep -E "FAILED|passed|failed" "$OUT/fp8_moe_tests.log" | tail -20
    ;;
  models37)  # issue 37: GPT-OSS-20B and Nemotron-H-8B against their floors and at max load;
    # issue 33: Mixtral-8x7B FP8 (dummy) at max load beside BF16
    export PYTHONUNBUFFERED=1
    step models37 300 python3 benchmarks/gpu_models.py --parts floor,gptoss,nemotron \
      --budget 280
    step models33 280 python3 benchmarks/gpu_models.py --parts floor,mixtral_fp8,qwen3moe \
      --budget 260
    ;;
  models_h200)  # issues 33 and 37 on an H200, one call: the copy floor, then Mixtral BF16 and
    # FP8, Qwen3-30B-A3B, GPT-OSS-20B, Nemotron-H-8B, and the 24-layer Qwen3-Next and Llama 4
    # (their bf16 weights fit an H200 only); each at batch 1 and 128/128 max load, 512 at once
    export PYTHONUNBUFFERED=1
    step models_h200 580 python3 benchmarks/gpu_models.py --budget 565 --max-batch-size 512 \
      --parts floor,mixtral_fp8,mixtral,qwen3moe,gptoss,nemotron,qwen3next,llama4
    ;;
  round4)  # 2026-12-06 (fifth): the GPU suite, the FP8 experts' capture, MTP at a known acceptance
    export PYTHONUNBUFFERED=1
    GPU_SUITE_TIMEOUT=370 bash benchmarks/gpu_suite.sh
    step diag_fp8_moe 40 python3 benchmarks/gpu_diag_fp8_moe.py
    # three engine builds (plain, k = 1, k = 3): the plain one alone took 54 s on an H100
    step gpu_mtp 160 python3 benchmarks/gpu_mtp.py --budget 150 --out "$OUT/gpu_mtp.json"
    ;;
  round5)  # 2026-12-06 (sixth): the GPU suite (now with hybrid decode graphs), MTP's speed-up
    export PYTHONUNBUFFERED=1
    GPU_SUITE_TIMEOUT=380 bash benchmarks/gpu_suite.sh
    step gpu_mtp 160 python3 benchmarks/gpu_mtp.py --budget 150 --out "$OUT/gpu_mtp.json"
    ;;
  today6)  # 2026-12-06 (sixth), one short call: the GPU tests of the day's changes (hybrid
    # decode and piecewise graphs, VLM decode graphs, expert load stats; the fifth session's
    # block-fp8 and MTP fixes), then Nemotron-H-8B at batch 1 and max load with its graphs
    export PYTHONUNBUFFERED=1
    step day_tests 200 python3 -m pytest -q -p no:cacheprovider -n 8 --dist loadfile \
      tests/runner/test_cuda_graph.py tests/layers/test_moe_load.py \
      tests/models/test_nemotron_h_parity.py tests/models/test_qwen3_next_parity.py \
      tests/models/test_granite_hybrid_parity.py tests/models/test_hybrid_prefix_reuse.py \
      tests/multimodal/test_qwen2_5_vl.py tests/multimodal/test_gemma3_vl.py \
      tests/models/test_fp8_moe_models.py tests/speculative/test_mtp.py \
      tests/layers/test_mamba2_mixer.py tests/layers/test_gated_deltanet.py \
      tests/kernels/test_fused_moe.py tests/layers/test_state_batch.py
    step nemotron 250 python3 benchmarks/gpu_models.py --parts floor,nemotron --budget 240 \
      --max-batch-size 256
    ;;
  models33)  # issue 33's models in one call (Mixtral BF16 needs an H200; on an H100 it skips)
    export PYTHONUNBUFFERED=1
    step models33 585 python3 benchmarks/gpu_models.py --budget 570 --max-batch-size 512 \
      --parts floor,mixtral_fp8,qwen3moe,mixtral
    ;;
  models37b)  # issue 37's models in one call (Qwen3-Next-24l and Llama-4-24l need an H200)
    export PYTHONUNBUFFERED=1
    step models37b 585 python3 benchmarks/gpu_models.py --budget 570 --max-batch-size 512 \
      --parts floor,gptoss,nemotron,qwen3next,llama4
    ;;
  round4b)  # the fixes of round4's failures (block fp8 GEMM with 16-column blocks, the MTP
    # head's router dtype), MTP at a known acceptance, GPT-OSS-20B and Nemotron-H-8B (issue 37)
    export PYTHONUNBUFFERED=1
    step fixed_tests 60 python3 -m pytest -q -p no:cacheprovider -n 3 \
      tests/models/test_fp8_moe_models.py tests/speculative/test_mtp.py
    step models37 130 python3 benchmarks/gpu_models.py --parts floor,gptoss,nemotron \
      --budget 122 --max-batch-size 256
    step gpu_mtp 85 python3 benchmarks/gpu_mtp.py --budget 78 --out "$OUT/gpu_mtp.json"
    ;;
  visual39)  # issue 39 in one call: FLUX.1-dev and Wan 2.2 5B, ours vs diffusers (step and
    # pipeline), then TeaCache and FP8 against our uncached BF16 (speed-up and PSNR)
    export PYTHONUNBUFFERED=1
    step visual39 580 python3 benchmarks/gpu_flux_wan.py --parts step,pipeline,teacache,fp8 \
      --out "$OUT/flux_wan_all.json"
    ;;
  suite7)  # the whole GPU suite alone (the parallel part ran past 290 s on an H100 in the
    # seventh session: the default limits give it 450 s)
    bash benchmarks/gpu_suite.sh
    ;;
  today7)  # 2026-12-06 (seventh), one call: the GPU tests of the day's changes (verify and
    # draft-head graphs with hidden states, MLA's multi-query rows, the MXFP4 dequant from
    # bits, the decode-sized pair sort, FP8 experts' tiles), MTP's speed-up, the MXFP4
    # experts kernel alone, the FP8 experts' tile sweep (~400 s in all)
    export PYTHONUNBUFFERED=1
    step day_tests 70 python3 -m pytest -q -p no:cacheprovider -n 8 --dist loadfile \
      tests/kernels/test_mla_decode.py tests/kernels/test_fused_moe.py \
      tests/kernels/test_swiglu_moe_kernels.py tests/kernels/test_mxfp4.py \
      tests/kernels/test_mxfp4_bits.py tests/speculative/test_mtp.py \
      tests/speculative/test_eagle3.py tests/runner/test_verify_graphs.py \
      tests/runner/test_cuda_graph.py tests/speculative/test_spec_engine.py \
      tests/models/test_deepseek_parity.py tests/models/test_gpt_oss_parity.py \
      tests/kernels/test_fp8_moe_kernel.py tests/models/test_fp8_moe_models.py
    step gpu_mtp 90 python3 benchmarks/gpu_mtp.py --budget 84 --k 3 --corrupt 0,0.3 \
      --out "$OUT/gpu_mtp.json"
    step mxfp4 70 python3 benchmarks/gpu_mxfp4_moe.py --out "$OUT/mxfp4_moe.json" --budget 60
    step fp8_sweep 150 python3 benchmarks/gpu_fp8_moe_sweep.py --out "$OUT/fp8_moe_sweep.json" \
      --budget 110
    ;;
  tune8)  # 2026-12-07 plan, call 1 (~520 s): the dense GEMV sweep with the MoE models' shapes
    # (this device's table), the FP8 experts' sweep (applied to fp8_moe_configs.py), MTP at a
    # known acceptance, the sort-free MoE decode paths against the tile path (bf16 / FP8;
    # GPT-OSS's MXFP4). Each tuned file goes to .tuned/ (git-ignored: a machine still warm
    # keeps it for models8) and $OUT as soon as it is made. The new kernels' GPU tests run in
    # suite7 (python benchmarks/sm90_compile_check.py: they compile for sm_90)
    export PYTHONUNBUFFERED=1
    mkdir -p .tuned
    # the sort-free MoE decode kernels' first GPU run: models8 sends MoE steps to the tile
    # path (TLLM_MOE_DECODE_PATH=0) if their tests fail here
    timeout 75 python3 -m pytest -q -x -p no:cacheprovider -n 4 tests/kernels/test_moe_decode.py \
      tests/kernels/test_swiglu_moe_decode.py >"$OUT/pre_moe.log" 2>&1
    echo $? >.tuned/pre_moe_rc; echo "=== pre_moe rc=$(cat .tuned/pre_moe_rc)"
    tail -n 15 "$OUT/pre_moe.log"
    step gemv 115 python3 benchmarks/gpu_gemv.py --models all --budget 92 \
      --write-table device --json "$OUT/gpu_gemv.json"
    cp tllm/kernels/triton/configs/dense_gemv_*.json .tuned/ && cp .tuned/* "$OUT/"
    step fp8_sweep 120 python3 benchmarks/gpu_fp8_moe_sweep.py --out "$OUT/fp8_moe_sweep.json" \
      --budget 85
    step fp8_apply 20 python3 benchmarks/fp8_moe_table.py "$OUT/fp8_moe_sweep.json" \
      --apply tllm/kernels/triton/fp8_moe_configs.py
    cp tllm/kernels/triton/fp8_moe_configs.py .tuned/ && cp .tuned/* "$OUT/"
    step gpu_mtp 80 python3 benchmarks/gpu_mtp.py --budget 72 --k 3 --corrupt 0,0.3 \
      --out "$OUT/gpu_mtp.json"
    step moe_decode 75 python3 benchmarks/gpu_moe_decode.py --out "$OUT/moe_decode.json" \
      --budget 65
    step mxfp4 50 python3 benchmarks/gpu_mxfp4_moe.py --out "$OUT/mxfp4_moe.json" --budget 40
    ;;
  models8)  # call 2, right after tune8 (its tables from .tuned/ while the machine is warm):
    # issue 33's and 37's MoE models at batch 1 against their floors and at max load (~560 s)
    export PYTHONUNBUFFERED=1
    if [ -d .tuned ]; then
      cp .tuned/dense_gemv_*.json tllm/kernels/triton/configs/ 2>/dev/null
      cp .tuned/fp8_moe_configs.py tllm/kernels/triton/ 2>/dev/null
      echo "tables from .tuned: $(ls .tuned)"
      [ "$(cat .tuned/pre_moe_rc 2>/dev/null)" = 0 ] || export TLLM_MOE_DECODE_PATH=0
      echo "TLLM_MOE_DECODE_PATH=${TLLM_MOE_DECODE_PATH:-1}"
    fi
    step models8 500 python3 benchmarks/gpu_models.py --budget 455 --max-batch-size 512 \
      --parts floor,qwen3moe,gptoss,mixtral_fp8
    ;;
  models37c)  # issue 37's hybrid and Llama 4 models at 12 layers (one H100 holds them),
    # Nemotron-H with a bf16 state, Qwen3-30B-A3B at max load with an fp8 KV cache (twice the
    # batch the KV memory holds). Commit the tuned tables first: this call may start a new
    # machine
    export PYTHONUNBUFFERED=1
    step models37c 580 python3 benchmarks/gpu_models.py --budget 560 --max-batch-size 512 \
      --parts floor,qwen3next12,llama4_12,qwen3moe_fp8kv,nemotron_bf16state
    ;;
  models37d)  # issue 37's must-haves in one call (~560 s): Qwen3-Next and Llama 4 at 12
    # layers, then where GPT-OSS's batch-1 step goes (models37c's extras left for a later call)
    export PYTHONUNBUFFERED=1
    # (M37_BUDGET shortens the models; M37_PROFILE=0 leaves the profile out: a short budget)
    budget=${M37_BUDGET:-410}
    step models37d $((budget + 20)) python3 benchmarks/gpu_models.py --budget "$budget" \
      --max-batch-size 512 --parts floor,qwen3next12,llama4_12
    [ "${M37_PROFILE:-1}" = 1 ] && step profile_gptoss 110 python3 \
      benchmarks/gpu_profile_decode.py --models dummy:gpt-oss-20b,dummy:qwen3-30b-a3b \
      --batch 1 --osl 32 --budget 100
    ;;
  after37)  # the call after models37c (~560 s): where GPT-OSS's batch-1 step goes (the ninth
    # session left it at 33.8% of its floor), the FP8 experts' tiles swept and applied, then
    # Mixtral FP8 and Qwen3-30B-A3B again on the applied FP8 table and the H100's GEMV table
    export PYTHONUNBUFFERED=1
    step profile_gptoss 110 python3 benchmarks/gpu_profile_decode.py \
      --models dummy:gpt-oss-20b,dummy:qwen3-30b-a3b --batch 1 --osl 32 --budget 100
    step fp8_sweep 120 python3 benchmarks/gpu_fp8_moe_sweep.py --out "$OUT/fp8_moe_sweep.json" \
      --budget 85
    step fp8_apply 20 python3 benchmarks/fp8_moe_table.py "$OUT/fp8_moe_sweep.json" \
      --apply tllm/kernels/triton/fp8_moe_configs.py
    cp tllm/kernels/triton/fp8_moe_configs.py "$OUT/"
    step models10 290 python3 benchmarks/gpu_models.py --budget 255 --max-batch-size 512 \
      --parts floor,qwen3moe,mixtral_fp8
    ;;
  stage)  # the first half of the SmolLM2 GGUF, carried alone
    cp .smol/a/part /tmp/smol_a && ls -la /tmp/smol_a ;;
  *) echo "usage: $0 quant|serving|spec|kernels|window|video_serve|load|gemv|after|stalls|suite|scale|round3|round3_vlm|verify|next|fp8moe|models37|models_h200|round4|round4b|round5|today6|today7|suite7|tune8|models8|models37c|models37d|after37|models33|models37b|visual39|stage|smollm2 ..."; exit 2 ;;
esac
done
