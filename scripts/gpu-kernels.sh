#!/bin/bash
# The kernel checks and measurements of one GPU call, for a lent GPU host
# without build tools: unpacks an sm_90 pack and a 75-virtual pack
# (scripts/gpu-pack.sh), then runs the steps named in LLM_KERNEL_STEPS,
# each bounded, logs under $OUT and a summary last:
#   ops      test_cuda_ops's matmul tests (every type; matmul_mmq.cu at every
#            token count) and test_cuda_attention's, sm_90 pack
#   ops75    the same routed as sm_75 (LLM_CUDA_SM=75) from the 75-virtual pack
#   forward  test_forward on the GPU (goldens; pycode Q4_K_M teacher-forced),
#            default routing and with LLM_CUDA_MMQ_MIN=1, both packs
#   mmq      bench_cuda mmq: the 7B shapes at batch 8-64, the other kernels
#            against matmul_mmq.cu, both packs
#   attn     bench_cuda attn with LLM_CUDA_ATT_GQA_MIN=0 (off) and 2 (default),
#            and the 75-virtual pack's
#   model    bench_gpu Q4_K_M at batch 1, 16, 64, both packs: llama2-7b at
#            context 512 and llama3-8b at context 2048, matmul_mmq.cu off
#            (LLM_CUDA_MMQ_MIN=0), routed by default, and given every
#            K-quant weight from 8 tokens (LLM_CUDA_MMQ_MIN=8)
#   mma      bench_mma: the tensor cores' mma.sync rate for each shape the
#            kernels use, both packs (docs/performance.md, "Tensor-core
#            ceilings"); the table in mma.log
#   ncu      Nsight Compute on one launch each of matmul_mmq.cu's and
#            attention_gqa.cu's kernels (bench_cuda mmq / attn), sm_90 pack
#   mrncu    Nsight Compute's memory and stall sections on four launches of
#            matmul_mr.cu (one layer's q/k/v, v, o and down) and one of
#            matmul_mmq.cu (gate/up) in llama3-8b Q4_K_M decode steps at
#            batch 16, context 2048, sm_90 pack: where the batch-16
#            matmuls' time goes against their bytes (L1 hits, L2 and DRAM
#            traffic, stall reasons)
#   prof     Nsight Compute's time of every kernel of Q4_K_M decode steps at
#            batch 16 and 64, added up by kernel and grid
#            (scripts/ncu-sum.py), sm_90 pack, for each SHAPE:CTX:MMQ_MIN of
#            LLM_PROF_CASES (default llama2-7b at context 512 routed by
#            default, -1, and with LLM_CUDA_MMQ_MIN=8); tables in prof.txt
#   verifyprof Nsight Compute's time of every kernel of speculation's
#            verification step (one sequence's 5 rows, bench_gpu --verify
#            4) against its one-row step, side by side (scripts/ncu-sum.py
#            --last-two), llama2-7b Q4_K_M at context 512 and llama3-8b at
#            2048, sm_90 pack; tables in verifyprof.txt
#   ab       bench_gpu decode A/Bs of routing choices, one line a setting
#            (ab.txt): llama2-7b Q4_K_M at context 512 and llama3-8b at
#            2048, LLM_CUDA_MMQ_MIN=0 against the default (both packs),
#            and LLM_CUDA_ROPE_ATT (sm_90)
#   attab    bench_gpu decode A/Bs of the attention's routing (attab.txt):
#            llama2-7b Q4_K_M at context 512, batch 12-24, the ungrouped
#            heads' 8-warp blocks off and on (LLM_CUDA_ATT_WIDE, both packs),
#            and llama3-8b at 2048, batch 8-64, attention_gqa.cu's ring off
#            and on (LLM_CUDA_ATT_RING=0,3, sm_90)
#   route    bench_cuda route (mq, matmul_wide.cu and matmul_mmq.cu on each
#            llama2-7b and llama3-8b matmul at 17-64 tokens), then bench_gpu
#            decode at 17-64 tokens, llama2-7b Q4_K_M at context 512 and
#            llama3-8b at 2048, the quantized matmuls routed as on sm_75
#            against the card's own routing (LLM_CUDA_MM_ROUTE=auto,sm75),
#            sm_90 pack
#   gqa      bench_gpu, llama3-8b Q4_K_M at context 2048, batch 16 and 64,
#            attention_gqa.cu off against on (sm_90 pack)
#   all      every test_cuda_ops, test_cuda_attention and test_forward test,
#            both packs
#   linkdtype bench_link_dtype --device cuda:0 (sm_90 pack, else the
#            75-virtual one) on the llama2-7b synthetic of each type in
#            LLM_LINKDTYPE_TYPES (q4_k_m; "q4_k_m f16" for both), which the
#            pack's llm-synth writes into a temp dir with room: f32, f16,
#            bf16, int8 and the --control row on bench/data/stories-eval.txt
#            (docs/deploy.md, "Across hosts"); the table in linkdtype.txt.
#            Its pack needs bench/bench_link_dtype and worker/llm-synth
#            (LLM_PACK_BINS="... bench/bench_link_dtype worker/llm-synth")
#   OUT=/tmp/out LLM_GPU_PACK=gpu-pack/sm90.tar.xz LLM_GPU_PACK_T4=gpu-pack/sm75.tar.xz \
#       LLM_KERNEL_STEPS="ops mmq" ./scripts/gpu-kernels.sh
set -u
cd "$(dirname "$0")/.." || exit 2
out=${OUT:-/tmp/gpu-kernels}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0
[ -f .deps/env.sh ] && . .deps/env.sh
unpack() {
    local pack=$1 build
    [ -f "$pack" ] || { echo ""; return; }
    build=$(tar -xJf "$pack" -O build.path) || { echo ""; return; }
    [ -d "$build" ] || tar -xJf "$pack" -C / --exclude=build.path
    echo "$build"
}
b90=$(unpack "${LLM_GPU_PACK:-gpu-pack/sm90.tar.xz}")
b75=$(unpack "${LLM_GPU_PACK_T4:-gpu-pack/sm75.tar.xz}")
models=${LLM_MODELS_DIR:-}
for b in "$b90" "$b75"; do
    [ -z "$models" ] && [ -n "$b" ] && [ -d "$b/models" ] && models=$b/models
done
export LLM_MODELS_DIR=$models
for b in "$b90" "$b75"; do
    [ -n "$b" ] && [ -d "$b/rt" ] && export LD_LIBRARY_PATH="$b/rt${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
done
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem --format=csv,noheader >"$out/machine.txt" 2>&1
summary=$out/summary.txt
: >"$summary"
status=0
# step NAME BOUND_S COMMAND...: the command's output in NAME.log, the test
# counts or the tables' last lines in the summary.
step() {
    local name=$1 bound=$2
    shift 2
    local t0
    t0=$(date +%s)
    timeout --kill-after=10 "$bound" "$@" >"$out/$name.log" 2>&1
    local rc=$?
    {
        echo "== $name: exit $rc, $(( $(date +%s) - t0 )) s"
        grep -E -B3 "^\[ FAIL \]" "$out/$name.log" | grep -v "^\[ RUN" | head -n 24
        grep -E "tests: |teacher-forced" "$out/$name.log" | head -n 4
    } >>"$summary"
    [ $rc -eq 0 ] || status=1
}
attn_tests="cuda_ops_attention_gqa cuda_ops_attention_gqa_q8_0 cuda_ops_attention_decode cuda_ops_attention_mixed
    cuda_ops_rope_kv_attention cuda_ops_attention_gqa_f16 cuda_ops_attention_shapes"
matmul_tests="cuda_ops_matmul_mmq cuda_ops_matmul_q4_k cuda_ops_matmul_q5_k cuda_ops_matmul_q6_k
    cuda_ops_matmul_multi cuda_ops_matmul_swiglu cuda_ops_matmul_reuses_input_safely
    cuda_ops_matmul_odd_width_and_tiles cuda_ops_matmul_wide cuda_ops_rmsnorm_feeds_matmul
    cuda_ops_rmsnorm_feeds_matmul_mmq"
for what in ${LLM_KERNEL_STEPS:-ops ops75 forward mmq attn}; do
    case $what in
    ops)
        [ -n "$b90" ] && step ops 200 "$b90/tests/test_cuda_ops" $matmul_tests
        [ -n "$b90" ] && step attention 200 "$b90/tests/test_cuda_attention" $attn_tests
        ;;
    ops75)
        [ -n "$b75" ] && LLM_CUDA_SM=75 step ops75 200 "$b75/tests/test_cuda_ops" $matmul_tests
        [ -n "$b75" ] && LLM_CUDA_SM=75 step attention75 200 "$b75/tests/test_cuda_attention" $attn_tests
        ;;
    forward)
        [ -n "$b90" ] && LLM_TEST_DEVICE=cuda:0 step forward 200 "$b90/tests/test_forward"
        [ -n "$b90" ] && LLM_CUDA_MMQ_MIN=1 LLM_TEST_DEVICE=cuda:0 step forward_mmq1 200 "$b90/tests/test_forward"
        [ -n "$b75" ] && LLM_CUDA_SM=75 LLM_TEST_DEVICE=cuda:0 step forward75 200 "$b75/tests/test_forward"
        ;;
    mmq)
        [ -n "$b90" ] && step mmq 240 "$b90/bench/bench_cuda" 0 mmq
        [ -n "$b75" ] && LLM_CUDA_SM=75 step mmq75 240 "$b75/bench/bench_cuda" 0 mmq
        ;;
    attn)
        for g in 0 2; do
            [ -n "$b90" ] && LLM_CUDA_ATT_GQA_MIN=$g step "attn_gqa$g" 120 "$b90/bench/bench_cuda" 0 attn
        done
        [ -n "$b75" ] && LLM_CUDA_SM=75 step attn75 120 "$b75/bench/bench_cuda" 0 attn
        ;;
    model)
        for b in "$b90" "$b75"; do
            [ -n "$b" ] || continue
            sm=""
            tag=90
            [ "$b" = "$b75" ] && { sm=75; tag=75; }
            LLM_CUDA_SM=$sm step "model7b_$tag" 280 "$b/bench/bench_gpu" --shapes llama2-7b --types q4_k_m \
                --batches 1,16,64 --ctx 512 --ab LLM_CUDA_MMQ_MIN=0,-1,8 --tmpdir /tmp
            LLM_CUDA_SM=$sm step "model8b_$tag" 280 "$b/bench/bench_gpu" --shapes llama3-8b --types q4_k_m \
                --batches 1,16,64 --ctx 2048 --ab LLM_CUDA_MMQ_MIN=0,-1,8 --tmpdir /tmp
        done
        ;;
    mma)
        [ -n "$b90" ] && step mma 60 "$b90/bench/bench_mma" 0
        [ -n "$b75" ] && step mma75 60 "$b75/bench/bench_mma" 0
        ;;
    ncu)
        sections="--section SpeedOfLight --section Occupancy --section WarpStateStats --section LaunchStats
            --section MemoryWorkloadAnalysis --section SchedulerStats"
        [ -n "$b90" ] && step ncu_mmq 150 ncu --clock-control none --kernel-name regex:matmul_mmq \
            --launch-skip 30 --launch-count 1 $sections "$b90/bench/bench_cuda" 0 mmq
        [ -n "$b90" ] && step ncu_gqa 150 ncu --clock-control none --kernel-name regex:attention_gqa_kernel \
            --launch-skip 200 --launch-count 1 $sections "$b90/bench/bench_cuda" 0 attn
        ;;
    mrncu)
        [ -n "$b90" ] || continue
        sections="--section SpeedOfLight --section Occupancy --section WarpStateStats --section LaunchStats
            --section MemoryWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables --section SchedulerStats"
        mrargs="--shapes llama3-8b --types q4_k_m --batches 16 --ctx 2048 --prompt 8 --prefill-reps 1 --warmup 1
            --steps 6 --copy-size 64M --gemm-size 1024 --gemm-tokens 256 --tmpdir /tmp"
        # Past the prefills' launches (at most 5 a layer), inside the decode
        # steps (4 a layer on matmul_mr.cu, 1 on matmul_mmq.cu).
        step ncu_mr 200 ncu --clock-control none --kernel-name regex:matmul_mr_kernel --launch-skip 600 \
            --launch-count 4 $sections "$b90/bench/bench_gpu" $mrargs
        step ncu_mr_mmq 200 ncu --clock-control none --kernel-name regex:matmul_mmq --launch-skip 150 \
            --launch-count 1 $sections "$b90/bench/bench_gpu" $mrargs
        ;;
    prof)
        [ -n "$b90" ] || continue
        for pc in ${LLM_PROF_CASES:-llama2-7b:512:-1 llama2-7b:512:8}; do
            IFS=: read -r shape ctx mm <<<"$pc"
            for bt in 16 64; do
                echo "== $shape q4_k_m, batch $bt, context $ctx, LLM_CUDA_MMQ_MIN=$mm: totals of 2 prefills of 8" \
                    "tokens and 3 decode steps (a decode kernel's launches: 3 a layer and step)"
                LLM_CUDA_MMQ_MIN=$mm timeout 150 ncu --csv --metrics gpu__time_duration.sum --clock-control none \
                    --cache-control none "$b90/bench/bench_gpu" --shapes "$shape" --types q4_k_m --batches $bt \
                    --ctx "$ctx" --prompt 8 --prefill-reps 1 --warmup 1 --steps 2 --copy-size 64M --gemm-size 1024 \
                    --gemm-tokens 256 --tmpdir /tmp 2>&1 | env -u LD_LIBRARY_PATH python3 scripts/ncu-sum.py | head -n 40
            done
        done >"$out/prof.txt" 2>&1
        echo "== prof: $(grep -c '^all kernels' "$out/prof.txt") tables" >>"$summary"
        ;;
    verifyprof)
        [ -n "$b90" ] || continue
        for sc in llama2-7b:512 llama3-8b:2048; do
            IFS=: read -r shape ctx <<<"$sc"
            echo "== $shape q4_k_m, context $ctx: the 5-row step (last) against the 1-row step (next to last)"
            timeout 200 ncu --csv --metrics gpu__time_duration.sum --clock-control none --cache-control none \
                "$b90/bench/bench_gpu" --shapes "$shape" --types q4_k_m --batches 1 --ctx "$ctx" --verify 4 \
                --steps 1 --warmup 0 --prompt 8 --prefill-reps 1 --copy-size 64M --gemm-size 1024 --gemm-tokens 256 \
                --tmpdir /tmp 2>&1 | env -u LD_LIBRARY_PATH python3 scripts/ncu-sum.py --last-two
        done >"$out/verifyprof.txt" 2>&1
        echo "== verifyprof: $(grep -c '^== last step' "$out/verifyprof.txt") tables" >>"$summary"
        ;;
    ab)
        abrun() { # TAG PACK SM BENCH_GPU_ARGS...
            local tag=$1 b=$2 sm=$3
            shift 3
            echo "== $tag: $*"
            LLM_CUDA_SM=$sm timeout 200 "$b/bench/bench_gpu" --tmpdir /tmp "$@" 2>&1 |
                awk '$3 == "decode" {printf "%-10s batch %3s ctx %5s  %7s ms  %s\n", $1, $5, $6, $8, $NF}'
        }
        {
            for b in "$b90" "$b75"; do
                [ -n "$b" ] || continue
                sm=""
                tag=sm90
                [ "$b" = "$b75" ] && { sm=75; tag=t4code; }
                abrun $tag "$b" "$sm" --shapes llama2-7b --types q4_k_m --batches 1,8,16,32,64 --ctx 512 \
                    --ab LLM_CUDA_MMQ_MIN=0,-1
                abrun $tag "$b" "$sm" --shapes llama3-8b --types q4_k_m --batches 1,16,64 --ctx 2048 \
                    --ab LLM_CUDA_MMQ_MIN=0,-1
            done
            if [ -n "$b90" ]; then
                abrun sm90 "$b90" "" --shapes llama2-7b --types q4_k_m --batches 8,16 --ctx 512 \
                    --ab LLM_CUDA_ROPE_ATT=-1,4,8
            fi
        } >"$out/ab.txt" 2>&1
        echo "== ab: $(grep -c ' ms ' "$out/ab.txt") rows" >>"$summary"
        ;;
    attab)
        {
            for b in "$b90" "$b75"; do
                [ -n "$b" ] || continue
                sm=""
                [ "$b" = "$b75" ] && sm=75
                echo "== ${sm:+LLM_CUDA_SM=$sm }llama2-7b, --ab LLM_CUDA_ATT_WIDE=false,true"
                LLM_CUDA_SM=$sm timeout 200 "$b/bench/bench_gpu" --tmpdir /tmp --shapes llama2-7b --types q4_k_m \
                    --batches 12,16,24 --ctx 512 --ab LLM_CUDA_ATT_WIDE=false,true 2>&1 |
                    awk '$3 == "decode" {printf "batch %3s  %7s ms  %s\n", $5, $8, $NF}'
            done
            if [ -n "$b90" ]; then
                echo "== llama3-8b, --ab LLM_CUDA_ATT_RING=0,3"
                timeout 240 "$b90/bench/bench_gpu" --tmpdir /tmp --shapes llama3-8b --types q4_k_m \
                    --batches 8,16,32,64 --ctx 2048 --ab LLM_CUDA_ATT_RING=0,3 2>&1 |
                    awk '$3 == "decode" {printf "batch %3s  %7s ms  %s\n", $5, $8, $NF}'
            fi
        } >"$out/attab.txt" 2>&1
        echo "== attab: $(grep -c ' ms ' "$out/attab.txt") rows" >>"$summary"
        ;;
    route)
        [ -n "$b90" ] && step route_kernels 300 "$b90/bench/bench_cuda" 0 route
        [ -n "$b90" ] && step route7b 280 "$b90/bench/bench_gpu" --shapes llama2-7b --types q4_k_m \
            --batches 17,24,32,48,64 --ctx 512 --ab LLM_CUDA_MM_ROUTE=auto,sm75 --tmpdir /tmp
        [ -n "$b90" ] && step route8b 280 "$b90/bench/bench_gpu" --shapes llama3-8b --types q4_k_m \
            --batches 17,24,32,48,64 --ctx 2048 --ab LLM_CUDA_MM_ROUTE=auto,sm75 --tmpdir /tmp
        ;;
    gqa)
        [ -n "$b90" ] && step model8b_gqa 280 "$b90/bench/bench_gpu" --shapes llama3-8b --types q4_k_m \
            --batches 16,64 --ctx 2048 --ab LLM_CUDA_ATT_GQA_MIN=0,2 --tmpdir /tmp
        ;;
    linkdtype)
        # The 7B synthetic row of the --link-dtype table: its weights are
        # random, so its perplexity is about the vocabulary's size and means
        # nothing; the agreement with F32 links and the bytes are the row.
        lb=$b90 lsm=""
        [ -z "$lb" ] && { lb=$b75; lsm=75; }
        t0=$(date +%s)
        lrc=2
        {
            ldir=""
            for d in "${LLM_LINKDTYPE_TMP:-}" "${TMPDIR:-/tmp}" /tmp /dev/shm "$PWD"; do
                # a file is about 4 GB (q4_k_m) or 13.5 GB (f16), one at a
                # time; 16 GiB free leaves the machine some
                [ -n "$d" ] && [ -d "$d" ] && [ -w "$d" ] &&
                    [ "$(df -Pk "$d" | awk 'NR == 2 {print $4}')" -ge $((16 * 1024 * 1024)) ] &&
                    ldir=$(mktemp -d "$d/linkdtype.XXXXXX") && break
            done
            if [ -z "$lb" ]; then
                echo "linkdtype: no GPU pack"
            elif [ ! -x "$lb/bench/bench_link_dtype" ] || [ ! -x "$lb/worker/llm-synth" ]; then
                echo "linkdtype: $lb lacks bench/bench_link_dtype or worker/llm-synth (LLM_PACK_BINS of gpu-pack.sh)"
            elif [ -z "$ldir" ]; then
                echo "linkdtype: no temp dir with 16 GiB free (LLM_LINKDTYPE_TMP)"
            else
                for lt in ${LLM_LINKDTYPE_TYPES:-q4_k_m}; do
                    lm=$ldir/llama2-7b-$lt.gguf
                    ls0=$(date +%s)
                    timeout 300 "$lb/worker/llm-synth" --out "$lm" --shape llama2-7b --type "$lt" --log-level warn
                    lrc=$?
                    echo "linkdtype: llm-synth --shape llama2-7b --type $lt: exit $lrc, $(( $(date +%s) - ls0 )) s"
                    [ $lrc -eq 0 ] || break
                    echo "+ bench/bench_link_dtype --device cuda:0 --model $lm --text bench/data/stories-eval.txt" \
                        "--max-tokens 4096 --control${lsm:+ (LLM_CUDA_SM=$lsm)}"
                    LLM_CUDA_SM=$lsm timeout --kill-after=10 170 "$lb/bench/bench_link_dtype" --device cuda:0 \
                        --model "$lm" --text bench/data/stories-eval.txt --max-tokens 4096 --control
                    lrc=$?
                    rm -f "$lm"
                    [ $lrc -eq 0 ] || break
                done
            fi
            [ -n "$ldir" ] && rm -rf "$ldir"
        } >"$out/linkdtype.txt" 2>&1
        {
            echo "== linkdtype: exit $lrc, $(( $(date +%s) - t0 )) s"
            grep -E "^model |^\| [a-z0-9]+|^linkdtype:|^bench_link_dtype:" "$out/linkdtype.txt" | head -n 20
        } >>"$summary"
        [ $lrc -eq 0 ] || status=1
        ;;
    all)
        [ -n "$b90" ] && step all_ops 300 "$b90/tests/test_cuda_ops"
        [ -n "$b90" ] && step all_attention 300 "$b90/tests/test_cuda_attention"
        [ -n "$b90" ] && LLM_TEST_DEVICE=cuda:0 step all_forward 200 "$b90/tests/test_forward"
        [ -n "$b75" ] && LLM_CUDA_SM=75 step all_ops75 300 "$b75/tests/test_cuda_ops"
        [ -n "$b75" ] && LLM_CUDA_SM=75 step all_attention75 300 "$b75/tests/test_cuda_attention"
        ;;
    esac
done
cat "$summary"
for f in "$out"/ncu*.log; do
    [ -f "$f" ] && { echo "== $f"; grep -E "Duration|Throughput|Achieved Occupancy|Registers|Stall|Warp Cycles|Eligible|Issued|Block Limit|Grid Size|L1/TEX Hit|L2 Hit|Mem Busy|Max Bandwidth" "$f" | head -n 40; }
done
for f in "$out"/mmq*.log "$out"/attn*.log "$out"/model*.log; do
    [ -f "$f" ] && { echo "== $f"; tail -n 30 "$f"; }
done
exit $status
