#!/usr/bin/env bash
# The lent GPU's checks (issue 18, docs/gpu_session.md) as one command, stage by stage:
#
#   bash scripts/gpu_session.sh info suite+capacity pinned fit peers   # about 7 minutes
#
# Each stage has its own time limit (the machine lends 10 minutes a command), writes its log
# and results under benchmarks/results/ (gpu_*), and packs them into $OUT/gpu_results.tgz when
# it ends, so a call cut short still brings back what the finished stages found. A failing
# stage is a finding, not the end of the call.
#   cuda_tests       the tests marked cuda alone
#   suite            the whole suite on the GPU alone (12 workers)
#   capacity         the capacity search alone, from $START_LAYERS (56) layers, 300 s (less where
#                    CALL_SECONDS, the call's limit, leaves less; so for nvme's 185 s)
#   suite+capacity   the whole suite on the GPU, the cuda tests included (pytest-xdist, 10 workers),
#                    beside the capacity search (an 8 GiB budget, states on the host, from 56
#                    layers); the search's figure is memory (its step times are taken beside the
#                    suite: not timings)
#   rerun            the tests named in $RERUN (node ids), on the GPU
#   diag             scripts/gpu_diag.py: the backward detection per placement, and whether torch on
#                    parameter views aligned like the allocator's tensors is bit-equal to torch;
#                    then scripts/gpu_alias_diag.py (gpu_alias.log): can a parameter on the host stay
#                    a CUDA tensor over its pinned memory and keep its autograd accumulator
#   peers            gemini, DeepSpeed ZeRO-2 offload and torchao side by side (wheels in .whl/)
#   peers_accum      the same (after peers) with 4 micro-batches a step (gpu_peers_accum4.md)
#   peers_torchao    torch, gemini ratio 0, torchao, and gemini ratio 1 at torchao's peak (gpu_peers_torchao.md)
#   peers_nvml_off   gemini ratio 0 and torchao with no NVML sampler in their processes (gpu_peers_nvml_off.md)
#   stepdiag         scripts/gpu_step_diag.py for torch, gemini ratio 1 and ratio 0 (or those in $STEPDIAG) on the 355M GPT: the
#                    allocations live at each one's peak, by the code that made them, and the step's
#                    phases (does the backward return ahead of the GPU?) (gpu_stepdiag_*.log)
#   dynamic          bench_dynamic_shapes.py: auto under dynamic padding, covering plans against tracing
#                    at every new shape (gpu_dynamic_shapes.md), and batches cut to a token budget,
#                    kept plans against one plan at a time (gpu_dynamic_shapes_tokens.md)
set -u
OUT=${OUT:-/tmp/gpu_out}
mkdir -p "$OUT"
R=benchmarks/results
mkdir -p "$R"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PY:-python3}
PYTEST=("$PY" -m pytest -q -p no:cacheprovider -rfE)

pack() { tar czf "$OUT/gpu_results.tgz" $R/gpu_* 2>/dev/null; }

stage() {  # name seconds command...: the command under a limit, its output in $R/gpu_<name>.log
    local name=$1 limit=$2
    shift 2
    local begin=$SECONDS
    timeout -s INT -k 10 "$limit" "$@" >"$R/gpu_$name.log" 2>&1
    local rc=$?
    echo "== $name: exit $rc after $((SECONDS - begin)) s (limit $limit s); last lines:"
    tail -n 25 "$R/gpu_$name.log" | cut -c1-300
    pack
}

search_limit() {  # most: a capacity search's seconds, less where CALL_SECONDS (the device call's
    # timeout_s) leaves less (it stops 25 s before the call's end); fails under 60 s
    local limit=$1
    if [ -n "${CALL_SECONDS:-}" ]; then
        local left=$((CALL_SECONDS - SECONDS - 25))
        [ "$left" -lt "$limit" ] && limit=$left
    fi
    [ "$limit" -ge 60 ] && echo "$limit"
}

for s in "$@"; do
    case $s in
        info)
            { date -u; nvidia-smi; "$PY" -c "import torch, sys; print(sys.version); print('torch', torch.__version__, \
'cuda', torch.version.cuda, torch.cuda.get_device_name(0), torch.cuda.mem_get_info())"; nproc; free -g; df -h /tmp; } \
                >"$R/gpu_info.log" 2>&1
            cat "$R/gpu_info.log" | head -40; pack ;;
        cuda_tests)
            stage cuda_tests 90 "${PYTEST[@]}" -m cuda --timeout 60 tests ;;
        suite+capacity)
            stage capacity 150 "$PY" benchmarks/bench_gpu_capacity.py --device cuda --start-layers 56 --time-limit 140 &
            GEMINI_TEST_DEVICE=cuda OMP_NUM_THREADS=1 stage suite 150 "${PYTEST[@]}" -n 10 --timeout 120 \
                --junitxml="$R/gpu_suite.xml" tests
            wait ;;
        suite)
            GEMINI_TEST_DEVICE=cuda OMP_NUM_THREADS=1 stage suite "${SUITE_SECONDS:-200}" "${PYTEST[@]}" -n 12 --timeout 120 \
                --junitxml="$R/gpu_suite.xml" tests ;;
        capacity)
            limit=$(search_limit 300) || { echo "== capacity: skipped, too little time left"; continue; }
            stage capacity $((limit + 10)) "$PY" benchmarks/bench_gpu_capacity.py --device cuda \
                --start-layers "${START_LAYERS:-56}" --time-limit "$limit" ;;
        pinned)
            stage pinned 45 "$PY" benchmarks/bench_pinned_copies.py --rounds 5 ;;
        dynamic)
            stage dynamic 90 "$PY" benchmarks/bench_dynamic_shapes.py --device cuda --steps 24 --out gpu_dynamic_shapes
            stage dynamic_tokens 90 "$PY" benchmarks/bench_dynamic_shapes.py --device cuda --steps 24 \
                --batching tokens --out gpu_dynamic_shapes_tokens ;;
        fit)
            stage fit 70 "$PY" benchmarks/bench_gpu_capacity.py --device cuda --fit --budget 4GiB --embd 1024 --steps 4 \
                --time-limit 64 ;;
        nvme)
            mkdir -p /tmp/nvme
            limit=$(search_limit "${NVME_SECONDS:-185}") || { echo "== nvme: skipped, too little time left"; continue; }
            stage nvme $((limit + 15)) "$PY" benchmarks/bench_gpu_capacity.py --device cuda --nvme-dir /tmp/nvme \
                --cpu-memory 16GiB --start-layers "${START_LAYERS:-56}" --steps "${NVME_STEPS:-3}" --time-limit "$limit" ;;
        peers)
            "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
                >"$R/gpu_peers_install.log" 2>&1 || echo "peer wheels: install failed (see gpu_peers_install.log)"
            PYTHONPATH="/tmp/site:$PYTHONPATH" stage peers 400 "$PY" benchmarks/bench_peers.py --device cuda \
                --model gpt-350m --steps 5 --warmup 2 --timeout 150 ;;  # DeepSpeed compiles its CPU Adam: > 75 s
        peers_torchao)  # torch, gemini ratio 0 and torchao, then gemini ratio 1 at torchao's peak (about 110 s)
            "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
                >"$R/gpu_peers_install.log" 2>&1 || echo "peer wheels: install failed (see gpu_peers_install.log)"
            PYTHONPATH="/tmp/site:$PYTHONPATH" stage peers_torchao 180 "$PY" benchmarks/bench_peers.py --device cuda \
                --model gpt-350m --steps 5 --warmup 2 --timeout 90 \
                --contenders "torch AdamW(fused),gemini auto (ratio 0),torchao CPUOffloadOptimizer"
            for f in json md; do [ -f "$R/gpu_peers.$f" ] && mv "$R/gpu_peers.$f" "$R/gpu_peers_torchao.$f"; done; pack ;;
        peers_nvml_off)  # after peers_torchao: gemini ratio 0 and torchao again without the NVML sampler's thread
            PYTHONPATH="/tmp/site:$PYTHONPATH" stage peers_nvml_off 150 "$PY" benchmarks/bench_peers.py --device cuda \
                --model gpt-350m --steps 7 --warmup 2 --timeout 70 --nvml-interval-ms 0 --at-peak-of none \
                --contenders "gemini auto (ratio 0),torchao CPUOffloadOptimizer"
            for f in json md; do [ -f "$R/gpu_peers.$f" ] && mv "$R/gpu_peers.$f" "$R/gpu_peers_nvml_off.$f"; done; pack ;;
        peers_accum)  # after peers (its wheels installed): gradient accumulation, 4 micro-batches a step
            PYTHONPATH="/tmp/site:$PYTHONPATH" stage peers_accum 200 "$PY" benchmarks/bench_peers.py --device cuda \
                --model gpt-350m --steps 4 --warmup 2 --timeout 60 --micro-batches 4 --at-peak-of none \
                --contenders "torch AdamW(fused),gemini auto (ratio 0),DeepSpeed ZeRO-2 offload,torchao CPUOffloadOptimizer" ;;
        diag)
            stage diag 60 "$PY" scripts/gpu_diag.py
            stage alias 40 "$PY" scripts/gpu_alias_diag.py ;;
        stepdiag)
            [ -d /tmp/site ] || "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl >"$R/gpu_peers_install.log" 2>&1
            for c in ${STEPDIAG:-torch gemini-ratio1 gemini-ratio0}; do
                PYTHONPATH="/tmp/site:$PYTHONPATH" stage "stepdiag_$c" 90 "$PY" scripts/gpu_step_diag.py --contender "$c" ${STEPDIAG_ARGS:-}
            done ;;
        rerun)
            GEMINI_TEST_DEVICE=cuda OMP_NUM_THREADS=1 stage rerun 120 "${PYTEST[@]}" -n 8 --timeout 60 ${RERUN:-tests/test_equivalence.py} ;;
        *)
            echo "unknown stage $s"; exit 2 ;;
    esac
done
pack
ls -la "$OUT"
