#!/usr/bin/env bash
# The GPU checks and measurements that were written on CPU and wait for a GPU, by step, so that
# one device call runs several with no time lost between them. Each step runs under its own time
# limit; its log goes to $OUT/<step>.log (or /tmp/gpu_round) and a line per step is printed at the
# end (exit status, seconds). The steps print their own tables; docs/perf.md keeps the results.
# Call it without a pipe (`| tail` waits for every step; the device's reply already keeps the
# output's end); the device returns at most 8 files, so the test files' logs stay in /tmp.
#
#   bench/gpu_round.sh tests overlap            # steps in the order given
#   TESTS="moe padded" TEST_LIMIT=70 bench/gpu_round.sh tests rl
#
# steps (rough H100 minutes):
#   tests    the CUDA cases of the kernel, engine and format tests (pytest -m "not slow") ...... ~3
#   overlap  gpu_engine.py: W1/W2 with the host overlap off and on, llama-1b and llama-8b ...... ~4
#   gguf     llama-8b of random GGUF blocks on W3: Triton expansion vs PyTorch vs bf16 ........... ~5
#   first    first-call cost, Triton cache cold and warm, llama-1b ................................ ~2
#   workloads W1/W3 at the default budget, llama-1b and llama-8b, against transformers ........... ~8
#   actquant FP8/INT8 GEMMs and llama-8b W1 per scheme against bf16 (issue 22) ..................... ~8
#   moe      the fused MoE kernel (tuned) and 30B-A3B W1 against transformers (issue 17) ........... ~10
#   det      llama-8b W1/W3: default, deterministic (TP-invariant), tp_invariant=False .............. ~6
#   rl       logprobs_padded vs logprobs on W1 as [256, L], update_weights of llama-8b (issue 20) .. ~4
#   ray      Ray Data, one replica, against the library on llama-1b (issue 18; ray carried) ....... ~4
#   long     llama-8b W4: one 32k and one 128k sequence, and the 128k one against transformers' trunk ... ~4
#   options  W1 plain vs temperature 0.7 + top-5 + entropy, llama-1b and llama-8b (issue 19) ............ ~3
#   head     the head alone at M = 16k, V = 128k: fused (+entropy, +top-20), chunked, packed Q6_K head ... ~3
#   hybridtests  the hybrid GPU tests (fla-core from .whl), the gated delta kernels and gated norm alone ... ~6
#   conv     the short conv alone: Triton vs batched PyTorch vs fla-core's, Qwen3.5-9B shapes (+ its tests) ... ~2
#   hybrid   Qwen3.5 hybrids' W1 against transformers with and without fla-core, logprobe's default and
#            deterministic rows in 2 alternating passes, no row 5 (a call of its own) ........................ ~7
#   families the Gemma 4 / Gemma 3 / GLM-4 / DeepSeek-V3 / GLM-4.5 CUDA tests, then the Gemma 4 E4B-like
#            cut against transformers with float32 weights on both sides (|delta| ~1e-5 if exact) ....... ~5
#   weightsync  2 GPUs: torchrl from .whl; the NCCL weight-sync tests (torchrl's SGLang scheme included), then
#            llama-8b pushed over NCCL by SGLang-style buckets and by torchrl's scheme (sockets) ............. ~10
#   prefix   the CUDA attention tests (keys read as slices, cu tensors once a pass) and the prefix cache on
#            llama-8b: RL groups one request per call / as one batch / 16 per call, multiple choice ........ ~5
#   moe2     2 GPUs: Qwen3-30B-A3B (16 layers) and MLA (12 layers) shapes at TP = EP = 1 vs 2, data- and
#            heads-split attention, default and deterministic ........................................ ~10
#   deepseek the MLA shape (bf16 / deterministic / FP8 blocks, 3 alternating passes) and the GLM-4.5-Air cut ... ~5
#   moe4     4 GPUs: the same two shapes at TP = EP = 1, 2 and 4, data-split attention ................... ~10
#   wide     top-k on the insertion path vs sorted merges: CUDA tests, the head alone, llama-8b W1 ........ ~6
#   deepseek_hf  the MLA shape and the GLM-4.5-Air cut against transformers (32 requests) ............. ~3
#   hybridmoe  the hybrid kernels' CUDA tests, qwen35-35b-a3b W1 vs transformers + fla, its profile ......... ~9
#   largest  2 GPUs: GLM-4.5-Air whole as FP8 blocks (106 GB, written to /dev/shm) at TP = EP = 2 ........ ~8
#   moesync  2 GPUs: the MoE CUDA tests, then Qwen3-30B-A3B (16 layers) profiled at 1 and 2 GPUs, the MLA shape .. ~9
#   moenccl  2 GPUs: the Qwen3 shape at 1 and 2 GPUs, NCCL_MAX_CTAS unset / 8 / 16 (NCCL_CTAS="..." to choose) ... ~5
#   transfers 2 GPUs: the MoE layer's gather / reduce-scatter over NCCL vs the copy engines, alone and beside products ~2
#   socketsync 2 GPUs: torchrl's weight sync over 1 socket, over the server's default 16, 16 set in both ~5
#   prefixcalls llama-8b RL groups 16 requests a call (all 256): timed, kernels and idle per call, CPU ops .... ~4
#   rlserver the rotary/attention CUDA tests, then llama-8b RL groups through the server at one batch budget ... ~8
#   profile  gpu_profile.py, where the GPU time goes (kernel families, GPU busy fraction): Qwen3.5-35B-A3B
#            (16 layers, fla-core from .whl) on 64 W1 requests, default and deterministic (~4), then the prefix
#            cache on llama-8b one request per call, 32 calls: wall / kernels / CPU ops per call (~2) ........ ~6
# TESTS="moe padded" (file stems) and TEST_LIMIT=70 (seconds per file) narrow the tests step;
# MOE_ARGS / ACTQ_ARGS replace the moe / actquant steps' arguments, MOE_LIMIT its time limit.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/gpu_round}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
py=${PYTHON:-python3}  # the GPU image has python3 and no python
summary=()

step() {  # name, time limit in seconds, command...
    local name=$1 limit=$2
    shift 2
    local t0=$SECONDS
    # -k: a process that ignores the TERM (seen on an H100: a test step that never ended) is killed
    timeout -k 15 "$limit" "$@" >"${logdir:-$out}/$name.log" 2>&1
    local rc=$?
    summary+=("$name rc=$rc $((SECONDS - t0)) s")
    echo "== $name rc=$rc $((SECONDS - t0)) s"
    tail -n "${lines:-40}" "${logdir:-$out}/$name.log"
}

for s in "$@"; do
    case $s in
        tests)  # one file per step: a file that hangs is named by its own line, the others still run
            mkdir -p /tmp/gpu_round_tests  # 14 logs: more than the device returns; their tails are printed
            for f in ${TESTS:-host_copy gguf_expand kernels act_quant_kernels elementwise_kernels invariant_kernels w4a16 \
                     attention_gpu moe padded gptq_awq nvfp4 budget}; do
                logdir=/tmp/gpu_round_tests lines=8 step "test_$f" "${TEST_LIMIT:-120}" "$py" -m pytest -q -m "not slow" -p no:cacheprovider "tests/test_$f.py"
            done ;;
        overlap) step overlap 400 "$py" bench/gpu_engine.py --models llama-1b,llama-8b --overlap --det-only ;;
        gguf) step gguf 500 "$py" bench/gpu_gguf.py --gguf-types Q4_K,Q8_0 ;;
        first) step first 300 "$py" bench/gpu_first_call.py --model llama-1b ;;
        workloads) step workloads 580 "$py" bench/gpu_workloads.py --models llama-1b,llama-8b --workloads W1,W3 \
            --budgets 32768 ;;
        actquant) step actquant 580 "$py" bench/gpu_act_quant.py ${ACTQ_ARGS:-} ;;
        moe) step moe "${MOE_LIMIT:-580}" "$py" bench/gpu_moe.py ${MOE_ARGS:---sections kernel,workloads,det,correct --workloads W1 --tune} ;;
        long) step long 500 "$py" bench/gpu_long.py --models llama-8b ;;
        options) step options 400 "$py" bench/gpu_options.py --models llama-1b,llama-8b ;;
        head) step head 400 "$py" bench/gpu_head.py ;;
        det) step det 580 "$py" bench/gpu_tp.py --workloads W1,W3 --modes default,det,det-notp ;;
        rl) step rl 300 env PYTHONPATH="${PYTHONPATH:-}:tests" "$py" bench/rl_padded.py --w1 llama-8b ;;
        ray) step ray 400 "$py" bench/gpu_ray.py ;;
        hybridtests)  # fla-core from the carried wheels, then the hybrid GPU tests and the kernels alone
            "$py" -m pip install -q --no-index --find-links .whl fla-core einops >/dev/null 2>&1
            step hybrid_tests 240 "$py" -m pytest -q -p no:cacheprovider tests/test_hybrid_gpu.py \
                tests/test_gated_delta_kernels.py tests/test_qwen3_next.py tests/test_short_conv_triton.py \
                tests/test_short_conv_model.py tests/test_gated_rmsnorm.py tests/test_qk_norm.py
            step hybrid_kernels 180 "$py" bench/gpu_gated_delta.py
            step gated_norm 120 "$py" bench/gpu_gated_norm.py ;;
        conv)  # the conv alone (fla-core from the carried wheels, for its causal_conv1d), then its CUDA tests
            "$py" -m pip install -q --no-index --find-links .whl fla-core einops >/dev/null 2>&1
            step conv 120 "$py" bench/gpu_gated_delta.py --conv-only
            step conv_tests 120 "$py" -m pytest -q -p no:cacheprovider tests/test_short_conv_triton.py \
                tests/test_short_conv_model.py tests/test_gated_delta_kernels.py tests/test_qk_norm.py ;;
        hybridmoe)  # one GPU, < 10 minutes: the hybrid kernels' CUDA tests, the MoE shape's W1 against
            # transformers + fla (two alternating logprobe passes), then its profile
            "$py" -m pip install -q --no-index --find-links .whl fla-core einops >/dev/null 2>&1
            step hybridmoe_tests 150 "$py" -m pytest -q -p no:cacheprovider tests/test_qk_norm.py \
                tests/test_gated_rmsnorm.py tests/test_hybrid_gpu.py
            step hybridmoe 300 "$py" bench/gpu_hybrid.py --models qwen35-35b-a3b --passes 2 --rows 1,2,3
            step hybridmoe_profile 130 "$py" bench/gpu_profile.py --scenario hybrid --models qwen35-35b-a3b \
                --layers 16 --profile-requests 64 ;;
        hybrid)  # a call of its own: W1 against transformers with and without fla-core (~9 minutes)
            "$py" -m pip install -q --no-index --find-links .whl fla-core einops >/dev/null 2>&1
            step hybrid 580 "$py" bench/gpu_hybrid.py --models qwen35-9b,qwen35-35b-a3b --passes 2 --rows 1,2,3,4 ;;
        families)  # installs nothing: the CUDA family tests, then the Gemma 4 shape at float32
            step families_tests 300 "$py" -m pytest -q -p no:cacheprovider tests/test_families_gpu.py
            step families_gemma4_f32 280 "$py" bench/gpu_families.py --models gemma4-e4b --dtype float32 \
                --hf-requests 16 ;;
        weightsync)  # 2 GPUs: torchrl + tensordict (+ requests) from the carried wheels
            "$py" -m pip install -q --no-index --find-links .whl torchrl==0.14.1 tensordict==0.14.3 requests >/dev/null 2>&1
            step weightsync_tests 420 "$py" -m pytest -q -rs -p no:cacheprovider tests/test_torchrl.py \
                tests/test_weight_sync_nccl.py
            step weightsync 580 "$py" bench/gpu_weight_sync.py
            step weightsync_torchrl 480 "$py" bench/gpu_weight_sync.py --client torchrl ;;
        socketsync)  # 2 GPUs: torchrl's scheme (NCCL over sockets) with NCCL's own single socket, with the
            # server's default 16 (NCCL takes the count from the listener), then 16 set in both processes
            "$py" -m pip install -q --no-index --find-links .whl torchrl==0.14.1 tensordict==0.14.3 requests fastapi \
                uvicorn click annotated-doc anyio >/dev/null 2>&1
            step socketsync_one 200 "$py" bench/gpu_weight_sync.py --client torchrl --repeats 2 \
                --server-env NCCL_SOCKET_NTHREADS=1 --server-env NCCL_NSOCKS_PERTHREAD=1
            step socketsync_server 200 "$py" bench/gpu_weight_sync.py --client torchrl --repeats 2
            step socketsync_both 200 env NCCL_SOCKET_NTHREADS=4 NCCL_NSOCKS_PERTHREAD=4 "$py" bench/gpu_weight_sync.py \
                --client torchrl --repeats 2 ;;
        prefix)  # the server wheels (uvicorn, fastapi) from .whl; then the tests, then the bench
            "$py" -m pip install -q --no-index --find-links .whl fastapi uvicorn click annotated-doc anyio requests >/dev/null 2>&1
            step prefix_tests 240 "$py" -m pytest -q -p no:cacheprovider tests/test_attention_gpu.py tests/test_gpu.py \
                tests/test_call_syncs.py tests/test_short_conv_triton.py
            step prefix 400 env PYTHONPATH="${PYTHONPATH:-}:bench" "$py" bench/cpu_prefix_cache.py --gpu-shape llama-8b \
                --checkpoint /tmp/llama8b --device cuda --groups 32 --samples 8 --prompt 1024 --response 512 \
                --questions 100 --context 800 --per-call 16 ;;
        moe2)
            step moe2_qwen3 400 "$py" bench/gpu_moe_parallel.py --shape qwen3-30b-a3b --layers 16 --sizes 1x1,2x2 \
                --attention data,tensor
            step moe2_mla 400 "$py" bench/gpu_moe_parallel.py --shape mla --layers 12 --sizes 1x1,2x2 --attention data,tensor ;;
        deepseek)  # one GPU: the MLA shape's rows (bf16, deterministic, FP8) in 3 alternating passes, GLM-4.5-Air cut
            step deepseek 540 "$py" bench/gpu_deepseek.py --models mla16b,glm-air --rows 1,2,3 --passes 3 ;;
        moe4)  # 4 GPUs: both shapes at 1, 2 and 4 GPUs, the default attention layout (data)
            step moe4_qwen3 290 "$py" bench/gpu_moe_parallel.py --shape qwen3-30b-a3b --layers 16 --sizes 1x1,2x2,4x4
            step moe4_mla 290 "$py" bench/gpu_moe_parallel.py --shape mla --layers 12 --sizes 1x1,2x2,4x4 ;;
        wide)  # one GPU: top-k on the insertion path vs sorted merges (tests, the head alone, the RL workload)
            step wide_tests 180 "$py" -m pytest -q -p no:cacheprovider tests/test_wide_topk.py
            step wide_head 240 "$py" bench/gpu_head.py --tune-topk --rep 100
            step wide_options 300 "$py" bench/gpu_options.py --models llama-8b --top-ks 64,128,256 ;;
        deepseek_hf)  # one GPU: the MLA shape and the GLM-4.5-Air cut against transformers on 32 requests
            step deepseek_hf 400 "$py" bench/gpu_deepseek.py --models mla16b,glm-air --rows 1,4 --hf-requests 32 ;;
        largest) step largest 580 "$py" bench/gpu_moe_parallel.py --shape glm-air --fp8 --sizes ${LARGEST_SIZES:-2x2} \
            --dir /dev/shm/moe ;;
        profile)  # fla-core from the carried wheels (the hybrid's gated delta kernels); each scenario its own limit
            "$py" -m pip install -q --no-index --find-links .whl fla-core einops >/dev/null 2>&1
            step profile_hybrid 330 "$py" bench/gpu_profile.py --scenario hybrid --models qwen35-35b-a3b --layers 16 \
                --profile-requests 64
            step profile_prefix 220 "$py" bench/gpu_profile.py --scenario prefix --gpu-shape llama-8b \
                --checkpoint /tmp/llama8b --calls 32 ;;
        moesync)  # 2 GPUs: the MoE CUDA tests (sync-free alignment, owned experts), then where two-GPU time goes
            step moesync_tests 300 "$py" -m pytest -q -p no:cacheprovider tests/test_moe.py tests/test_gpt_oss.py \
                tests/test_moe_parallel_gpu.py
            step moesync_qwen3 300 "$py" bench/gpu_moe_parallel.py --shape qwen3-30b-a3b --layers 16 --sizes 1x1,2x2 \
                --profile --modes default
            step moesync_mla 240 "$py" bench/gpu_moe_parallel.py --shape mla --layers 12 --sizes 1x1,2x2 ;;
        transfers)  # 2 GPUs: the MoE layer's gather and reduce-scatter over NCCL and over the copy engines
            step transfers_61k 150 "$py" bench/gpu_transfers.py --rows 61440
            step transfers_31k 150 "$py" bench/gpu_transfers.py --rows 30720 ;;
        moenccl)  # 2 GPUs: the Qwen3 shape at 1 vs 2 GPUs with NCCL held to fewer CTAs beside the expert kernels
            for ctas in ${NCCL_CTAS:-none 8 16}; do
                env_arg=""; [ "$ctas" != none ] && env_arg="--nccl-env NCCL_MAX_CTAS=$ctas"
                step "moenccl_$ctas" 200 "$py" bench/gpu_moe_parallel.py --shape qwen3-30b-a3b --layers 16 \
                    --sizes 1x1,2x2 --modes default $env_arg
            done ;;
        prefixcalls)  # one GPU: where a 16-request call's time goes (wall, kernels, idle per call)
            step prefixcalls 300 "$py" bench/gpu_profile.py --scenario prefix --gpu-shape llama-8b \
                --checkpoint /tmp/llama8b --calls 16 --per-call 16 ;;
        rlserver)  # one GPU: the server wheels, the launch-cut tests, then RL groups through the server
            "$py" -m pip install -q --no-index --find-links .whl fastapi uvicorn click annotated-doc anyio requests >/dev/null 2>&1
            step rlserver_tests 240 "$py" -m pytest -q -p no:cacheprovider tests/test_elementwise_kernels.py tests/test_gpu.py \
                tests/test_golden_bits.py tests/test_attention_gpu.py tests/test_call_syncs.py
            step rlserver 420 env PYTHONPATH="${PYTHONPATH:-}:bench" "$py" bench/cpu_prefix_cache.py --gpu-shape llama-8b \
                --checkpoint /tmp/llama8b --device cuda --groups 32 --samples 8 --prompt 1024 --response 512 \
                --per-call 16 --in-flight 64,256 --skip-mc --repeat 3 ;;
        *) echo "unknown step $s" >&2 ;;
    esac
done
printf '%s\n' "${summary[@]}"
