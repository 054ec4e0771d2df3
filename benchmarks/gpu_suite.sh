#!/usr/bin/env bash
# The benchmark suite on a GPU machine (NCCL), results in benchmarks/results/gpu/.
#
#     bash benchmarks/gpu_suite.sh                 # from the repository root, after `make install`
#     PYTHON=/path/to/python bash benchmarks/gpu_suite.sh
#     ONLY="measured exec_overhead" bash benchmarks/gpu_suite.sh    # a subset
#
# Runs, each writing its JSON into benchmarks/results/gpu/ (the CPU results in
# benchmarks/results/ are left alone):
#   plan_time, intra_op      planning speed (on this machine's CPU; no GPU use)
#   profile                  `planner profile` of the GPUs (NCCL, bf16 GEMMs): gpu/local_gpu.json
#   measured                 predicted vs measured step time of auto and Megatron plans,
#                            priced on that profile, on 2 and 4 GPUs (those that exist)
#   exec_overhead            generated Megatron tp program vs hand-written parallelize_module
#   plan_quality             auto vs Megatron plans (benchmarks.plan_quality)
# costmodel_fidelity is not run: it checks CPU (gloo) profiles only (it exits 2 on a
# GPU profile); the GPU profile's own fit residuals are in gpu/local_gpu.profile.json.
#
# Every rank is one GPU, so the multi-rank benchmarks need >= 2 GPUs; with one GPU
# they are skipped (and say so). The machine (nvidia-smi, topology, torch, git
# commit) is recorded in gpu/machine.txt and gpu/machine.json.
# Exit status: 0 all run, 1 some benchmark failed, 2 no GPU here.
set -u -o pipefail

cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-.venv/bin/python}"
OUT=benchmarks/results/gpu
ONLY="${ONLY:-plan_time intra_op profile measured exec_overhead plan_quality}"

die_no_gpu() {
    echo "gpu_suite: error: $1" >&2
    echo "gpu_suite: this suite needs a machine with NVIDIA GPUs, nvidia-smi and a CUDA build of torch;" >&2
    echo "gpu_suite: on a CPU machine run the CPU benchmarks instead (python -m benchmarks.measured, ...)" >&2
    exit 2
}

command -v nvidia-smi >/dev/null 2>&1 || die_no_gpu "nvidia-smi not found"
nvidia-smi -L >/dev/null 2>&1 || die_no_gpu "nvidia-smi finds no GPU"
[ -x "$PYTHON" ] || command -v "$PYTHON" >/dev/null 2>&1 || die_no_gpu "no python at '$PYTHON' (run make install, or set PYTHON)"
NGPU=$("$PYTHON" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)' 2>/dev/null) \
    || die_no_gpu "cannot import torch with $PYTHON"
[ "${NGPU:-0}" -ge 1 ] || die_no_gpu "torch.cuda.is_available() is False (a CPU-only torch build, or no usable GPU)"

mkdir -p "$OUT"
export OMP_NUM_THREADS=1

# ---- the machine --------------------------------------------------------------
{
    echo "# date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "# host: $(uname -a)"
    echo "# git: $(git rev-parse HEAD 2>/dev/null || echo unknown)$(git diff --quiet 2>/dev/null || echo ' (dirty)')"
    echo "# cpus: $(nproc)"
    echo; echo "## nvidia-smi"; nvidia-smi
    echo; echo "## nvidia-smi topo -m"; nvidia-smi topo -m 2>&1 || true
    echo; echo "## nvidia-smi --query-gpu"
    nvidia-smi --query-gpu=index,name,memory.total,driver_version,pcie.link.gen.current,pcie.link.width.current,clocks.max.sm \
        --format=csv 2>&1 || true
} > "$OUT/machine.txt"
"$PYTHON" - "$OUT/machine.json" <<'EOF'
import json, subprocess, sys
import torch
from costmodel.profiling import machine_info
info = machine_info()
info.update(cuda=torch.version.cuda, nccl=".".join(map(str, torch.cuda.nccl.version())),
            gpu_names=[torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
            gpu_memory_bytes=[torch.cuda.get_device_properties(i).total_memory
                              for i in range(torch.cuda.device_count())])
try:
    info["nvidia_smi"] = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                                         "--format=csv,noheader"], capture_output=True, text=True).stdout.strip()
    info["git_commit"] = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
except OSError:
    pass
json.dump(info, open(sys.argv[1], "w"), indent=1)
EOF
echo "gpu_suite: $NGPU GPU(s): $(nvidia-smi --query-gpu=name --format=csv,noheader | sort | uniq -c | xargs)"

# World sizes for the multi-rank benchmarks: 2 and 4, those that fit in the GPUs here.
WORLDS=""
for w in 2 4; do [ "$NGPU" -ge "$w" ] && WORLDS="$WORLDS $w"; done

FAILED=""
SKIPPED=""
STATUS="$OUT/suite_status.txt"
: > "$STATUS"
wants() { case " $ONLY " in *" $1 "*) return 0;; *) return 1;; esac; }
step() {  # step NAME COMMAND...: run, log to gpu/NAME.log, record the outcome
    local name=$1; shift
    echo "gpu_suite: $name: $*"
    local t0=$SECONDS
    if "$@" > "$OUT/$name.log" 2>&1; then
        echo "$name ok $((SECONDS - t0)) s" | tee -a "$STATUS"
    else
        echo "$name FAILED (status $?, $((SECONDS - t0)) s; see $OUT/$name.log)" | tee -a "$STATUS"
        tail -n 5 "$OUT/$name.log" >&2
        FAILED="$FAILED $name"
    fi
}
skip() { echo "$1 skipped: $2" | tee -a "$STATUS"; SKIPPED="$SKIPPED $1"; }

wants plan_time && step plan_time "$PYTHON" -m benchmarks.plan_time --out "$OUT/plan_time.json"
wants intra_op && step intra_op "$PYTHON" -m benchmarks.intra_op --out "$OUT/intra_op.json"

# One profile per world size (the cost model of each world is fitted on that world).
PROFILES=""
if wants profile || wants measured; then
    if [ -z "$WORLDS" ]; then
        skip profile "one GPU: the collectives need >= 2 ranks"
    else
        for w in $WORLDS; do
            step "profile_$w" "$PYTHON" -m app.cli profile --ranks "$w" -o "$OUT/local_gpu_$w.json"
            [ -f "$OUT/local_gpu_$w.profile.json" ] && PROFILES="$PROFILES $OUT/local_gpu_$w.profile.json"
        done
    fi
fi

if wants measured; then
    if [ -z "$WORLDS" ]; then
        skip measured "one GPU; each rank needs its own GPU"
    elif [ -n "$PROFILES" ]; then
        # shellcheck disable=SC2086
        step measured "$PYTHON" -m benchmarks.measured --worlds $WORLDS --profile $PROFILES -o "$OUT/measured.json"
    else
        # shellcheck disable=SC2086
        step measured "$PYTHON" -m benchmarks.measured --worlds $WORLDS -o "$OUT/measured.json"
    fi
fi

if wants exec_overhead; then
    if [ -z "$WORLDS" ]; then
        skip exec_overhead "one GPU; each rank needs its own GPU"
    else
        # shellcheck disable=SC2086
        step exec_overhead "$PYTHON" -m benchmarks.exec_overhead --worlds $WORLDS -o "$OUT/exec_overhead.json"
    fi
fi

if wants plan_quality; then
    if ! "$PYTHON" -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("benchmarks.plan_quality") is None)'; then
        skip plan_quality "benchmarks/plan_quality.py is not in this checkout"
    else
        help=$("$PYTHON" -m benchmarks.plan_quality --help 2>&1 || true)
        if grep -q -- "--output" <<<"$help"; then
            step plan_quality "$PYTHON" -m benchmarks.plan_quality --output "$OUT/plan_quality.json"
        elif grep -q -- "--out" <<<"$help"; then
            step plan_quality "$PYTHON" -m benchmarks.plan_quality --out "$OUT/plan_quality.json"
        else
            skip plan_quality "it takes no --output/--out; run it by hand so the CPU results are not overwritten"
        fi
    fi
fi

echo "gpu_suite: results in $OUT (status: $STATUS)"
if [ -n "$FAILED" ]; then
    echo "gpu_suite: failed:$FAILED" >&2
    exit 1
fi
exit 0
