#!/usr/bin/env bash
# The GPU checks and measurements of the open questions, by step, so that one device call runs
# several with no time lost between them. Each step runs under its own time limit; its log goes to
# $OUT/<step>.log (or /tmp/gpu_round) and a line per step is printed at the end (exit status,
# seconds). The steps print their own tables; docs/perf.md keeps the current figures. Call it
# without a pipe (`| tail` waits for every step; the device's reply already keeps the output's end);
# the device returns at most 8 files, so the test files' logs stay in /tmp.
#
#   bench/gpu_round.sh tests first            # steps in the order given
#   TESTS="moe padded" TEST_LIMIT=70 bench/gpu_round.sh tests
#
# steps (rough H100 minutes):
#   tests    the CUDA cases of the kernel, engine and format tests (pytest -m "not slow") ...... ~3
#   first    first score in a new process, every cache state, Qwen3.5-4B and llama-1b shapes ....... ~8
#   loads    the families' loads against transformers (MLA, Gemma 3, Phi-4-mini, Gemma 4), disk and page cache ~8
#   server   llama-8b W1 through the server, one request per sample, 64 in flight, two interleaved repeats ~4
#   workloads W1/W3 at the default budget, llama-1b and llama-8b, against transformers ........... ~8
#   det      llama-8b W1/W3: default, deterministic (TP-invariant), tp_invariant=False .............. ~6
#   hybrid   Qwen3.5 hybrids' W1 against transformers with and without fla-core, logprobe's default and
#            deterministic rows in 2 alternating passes, no row 5 (a call of its own) ........................ ~7
#   hybridmoe  the hybrid kernels' CUDA tests, qwen35-35b-a3b W1 vs transformers + fla ................... ~7
#   families the Gemma 4 / Gemma 3 / GLM-4 / DeepSeek-V3 / GLM-4.5 CUDA tests, then the Gemma 4 E4B-like
#            cut against transformers with float32 weights on both sides (|delta| ~1e-5 if exact) ....... ~5
#   weightsync  2 GPUs: torchrl from .whl; the NCCL weight-sync tests (torchrl's SGLang scheme included), then
#            llama-8b pushed over NCCL by SGLang-style buckets and by torchrl's scheme (sockets) ............. ~10
#   socketsync 2 GPUs: torchrl's weight sync over 1 socket, over the server's default 16, 16 set in both ~5
#   moe2     2 GPUs: Qwen3-30B-A3B (16 layers) and MLA (12 layers) shapes at TP = EP = 1 vs 2, data- and
#            heads-split attention, default and deterministic ........................................ ~10
#   moe4     4 GPUs: the same two shapes at TP = EP = 1, 2 and 4, data-split attention ................... ~10
#   largest  2 GPUs: GLM-4.5-Air whole as FP8 blocks (106 GB, written to /dev/shm) at TP = EP = 2 ........ ~8
#   moesync  2 GPUs: the MoE CUDA tests, then Qwen3-30B-A3B (16 layers) profiled at 1 and 2 GPUs, the MLA shape .. ~9
#   moenccl  2 GPUs: the Qwen3 shape at 1 and 2 GPUs, NCCL_MAX_CTAS unset / 8 / 16 (NCCL_CTAS="..." to choose) ... ~5
# TESTS="moe padded" (file stems) and TEST_LIMIT=70 (seconds per file) narrow the tests step.
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
                     attention_gpu moe padded gptq_awq nvfp4 budget gpu head_slices_gpu graphs_gpu}; do
                logdir=/tmp/gpu_round_tests lines=8 step "test_$f" "${TEST_LIMIT:-120}" "$py" -m pytest -q -m "not slow" -p no:cacheprovider "tests/test_$f.py"
            done ;;
        first) step first 580 "$py" bench/gpu_first_call.py --models qwen35-4b,llama-1b ;;
        loads) step loads 580 "$py" bench/gpu_first_call.py --models mla@8,gemma3-4b,phi4-mini,gemma4-e4b@12 --loads-only --dir /tmp ;;
        server) step server 400 "$py" bench/gpu_small_passes.py --shape llama-8b --server-only --in-flight 64 --clients 8 --repeat 2 ;;
        workloads) step workloads 580 "$py" bench/gpu_workloads.py --models llama-1b,llama-8b --workloads W1,W3 \
            --budgets 32768 ;;
        det) step det 580 "$py" bench/gpu_tp.py --workloads W1,W3 --modes default,det,det-notp ;;
        hybridmoe)  # one GPU, < 10 minutes: the hybrid kernels' CUDA tests, the MoE shape's W1 against
            # transformers + fla (two alternating logprobe passes)
            "$py" -m pip install -q --no-index --find-links .whl fla-core einops >/dev/null 2>&1
            step hybridmoe_tests 150 "$py" -m pytest -q -p no:cacheprovider tests/test_qk_norm.py \
                tests/test_gated_rmsnorm.py tests/test_hybrid_gpu.py
            step hybridmoe 300 "$py" bench/gpu_hybrid.py --models qwen35-35b-a3b --passes 2 --rows 1,2,3 ;;
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
        moe2)
            step moe2_qwen3 400 "$py" bench/gpu_moe_parallel.py --shape qwen3-30b-a3b --layers 16 --sizes 1x1,2x2 \
                --attention data,tensor
            step moe2_mla 400 "$py" bench/gpu_moe_parallel.py --shape mla --layers 12 --sizes 1x1,2x2 --attention data,tensor ;;
        moe4)  # 4 GPUs: both shapes at 1, 2 and 4 GPUs, the default attention layout (data)
            step moe4_qwen3 290 "$py" bench/gpu_moe_parallel.py --shape qwen3-30b-a3b --layers 16 --sizes 1x1,2x2,4x4
            step moe4_mla 290 "$py" bench/gpu_moe_parallel.py --shape mla --layers 12 --sizes 1x1,2x2,4x4 ;;
        largest) step largest 580 "$py" bench/gpu_moe_parallel.py --shape glm-air --fp8 --sizes ${LARGEST_SIZES:-2x2} \
            --dir /dev/shm/moe ;;
        moesync)  # 2 GPUs: the MoE CUDA tests (sync-free alignment, owned experts), then where two-GPU time goes
            step moesync_tests 300 "$py" -m pytest -q -p no:cacheprovider tests/test_moe.py tests/test_gpt_oss.py \
                tests/test_moe_parallel_gpu.py
            step moesync_qwen3 300 "$py" bench/gpu_moe_parallel.py --shape qwen3-30b-a3b --layers 16 --sizes 1x1,2x2 \
                --profile --modes default
            step moesync_mla 240 "$py" bench/gpu_moe_parallel.py --shape mla --layers 12 --sizes 1x1,2x2 ;;
        moenccl)  # 2 GPUs: the Qwen3 shape at 1 vs 2 GPUs with NCCL held to fewer CTAs beside the expert kernels
            for ctas in ${NCCL_CTAS:-none 8 16}; do
                env_arg=""; [ "$ctas" != none ] && env_arg="--nccl-env NCCL_MAX_CTAS=$ctas"
                step "moenccl_$ctas" 200 "$py" bench/gpu_moe_parallel.py --shape qwen3-30b-a3b --layers 16 \
                    --sizes 1x1,2x2 --modes default $env_arg
            done ;;
        *) echo "unknown step $s" >&2 ;;
    esac
done
printf '%s\n' "${summary[@]}"
