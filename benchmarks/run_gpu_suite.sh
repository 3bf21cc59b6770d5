#!/usr/bin/env bash
# Every GPU benchmark of the project in one go, inside one device call of under 10 minutes.
#
#   bash benchmarks/run_gpu_suite.sh            # results in $OUT (device tool) or results/gpu/
#   SUITE_BUDGET=900 bash benchmarks/run_gpu_suite.sh   # a longer run, elsewhere
#
# Stages (each with a hard time limit and, where the script has one, a soft --time-budget
# slightly below it so it writes its JSON before the limit):
#   quantize   benchmarks/speed.py quantize --device cuda      kernel bandwidth per bit width
#   memory     benchmarks/memory.py activations --device cuda  saved bytes and peak per method
#   step_time  benchmarks/speed.py step --device cuda          step time, stock vs ours
#   scaling    benchmarks/memory.py scaling --device cuda --budget-gb 16   deepest / widest GCN, GCNII
#   largest    benchmarks/largest_graph.py search --device cuda --ceiling-gib 16   largest graph
#
# Speed stages, run only when named in SUITE_STAGES (the default runs the five above):
#   cuda_tests  pytest -m cuda tests                       every CUDA test, kernels included
#   gat_edge    benchmarks/speed.py gat-edge --device cuda  the fused GAT edge stage
#   gatv2_edge  the same with --op gatv2 (its table in suite.log only: 8 files come back)
#   small       benchmarks/speed.py epoch --device cuda   CiteSeer-sized epoch vs FP32
#   products    benchmarks/budget.py products --hidden 32   ogbn-products-size GAT, 16 GiB
#   host_step_forward, host_step_version   speed.py step, GCN (stock, fixed and default 2-bit)
#               with graph_check "forward" / "version": the graph check's cost per step
#   host_overhead   benchmarks/speed.py host --device cuda: ops, possible syncs and the
#               syncs CUDA itself reports in one steady-state GCN step (suite.log only)
#   gat_probe   benchmarks/memory.py probe-peak --device cuda   GAT/GATv2 worst step, fixed vs default
#   replan      tests/policy/replan_time.py --device cuda   a re-planning step over the median
#               step, GAT and GCN (suite.log only)
#
# SUITE_STAGES=waiting runs what waits for a GPU, most needed first, in one call: the CUDA
# tests, step time of every model (stock, fixed and default 2 bits), the quantizer, the
# re-planning step, the GAT probe's peak, the CiteSeer epoch, the products GAT, the host's ops.
#
#   SUITE_STAGES=waiting bash benchmarks/run_gpu_suite.sh
#
#   SUITE_STAGES="host_step_forward host_step_version host_overhead" T_HOST=150 bash benchmarks/run_gpu_suite.sh
#
#   SUITE_STAGES="cuda_tests quantize gat_edge gatv2_edge step_time small products" bash benchmarks/run_gpu_suite.sh
#
# Writes at most 8 files (what the device tool brings back): one JSON per stage, suite.json
# (environment, each stage's command, exit code and seconds), suite.log (every stage's output)
# and SUMMARY.md (the tables, ready for docs/results/). A stage that fails or runs out of time
# does not stop the others. Limits are environment variables (seconds): SUITE_BUDGET (all,
# default 560), T_QUANTIZE (40), T_MEMORY (150; MEMORY_JOBS=3 configurations at once),
# T_STEP (70), T_SCALING (160), T_LARGEST (110), T_CUDA_TESTS (120), T_GAT_EDGE (60),
# T_SMALL (60), T_PRODUCTS (150); SCALING_BUDGET_GB and LARGEST_BUDGET_GB
# (default 16, GACT's GPU).
#
# From a session with a GPU lent (device tool), then copy the tables into docs/results/:
#   run(command="bash benchmarks/run_gpu_suite.sh", timeout_s=600)
set -u

cd "$(dirname "$0")/.."
OUTDIR="${OUT:-results/gpu}"
mkdir -p "$OUTDIR"
PY="${PYTHON:-$(command -v python3 || command -v python)}"
export PYTHONUNBUFFERED=1
LOG="$OUTDIR/suite.log"
STAGES="$OUTDIR/.stages.tsv"
: >"$LOG"
: >"$STAGES"

SUITE_BUDGET="${SUITE_BUDGET:-560}"
T_QUANTIZE="${T_QUANTIZE:-40}"
T_MEMORY="${T_MEMORY:-150}"
T_SCALING="${T_SCALING:-160}"
T_LARGEST="${T_LARGEST:-110}"
T_CUDA_TESTS="${T_CUDA_TESTS:-120}"
T_GAT_EDGE="${T_GAT_EDGE:-60}"
T_SMALL="${T_SMALL:-60}"
T_HOST="${T_HOST:-90}"
T_GAT_PROBE="${T_GAT_PROBE:-60}"
T_REPLAN="${T_REPLAN:-60}"
if [[ "${SUITE_STAGES:-}" == waiting ]]; then
    SUITE_STAGES="cuda_tests step_time quantize replan gat_probe small products host_overhead"
    : "${T_STEP:=90}" "${T_PRODUCTS:=110}" "${STEP_MODELS:=gcn,gat,gatv2,gcnii}"
    : "${STEP_METHODS:=stock,L1-2bit,L1-2bit-adaptive,L1-2bit-dense-reads}"
fi
SUITE_STAGES=" ${SUITE_STAGES:-quantize memory step_time scaling largest} "
T_STEP="${T_STEP:-70}"
T_PRODUCTS="${T_PRODUCTS:-150}"
# SUITE_DEVICE=cpu and the *_ARGS variables (extra arguments per stage, word-split) exist to
# dry-run the suite's mechanics on a machine without a GPU, with tiny sizes; SUITE_DRY_RUN=1
# sets them all (every stage on CPU at toy sizes, about a minute; tests/benchmarks runs it).
if [[ "${SUITE_DRY_RUN:-0}" == 1 ]]; then
    : "${SUITE_DEVICE:=cpu}" "${SCALING_BUDGET_GB:=0.05}" "${LARGEST_BUDGET_GB:=1}"
    : "${QUANTIZE_ARGS:=--rows 2000 --repeats 2 --warmup 1}"
    : "${MEMORY_ARGS:=--scale 0.002 --models gcn --methods stock,int2}"
    : "${STEP_ARGS:=--scale 0.002 --models gcn --warmup 1 --steps 2}"
    : "${SCALING_ARGS:=--models gcn --searches depth --depth-hidden 16 --max-depth 16}"
    : "${LARGEST_ARGS:=--models gcn --forms ours --slope-nodes 2000,4000 --max-trials 0}"
    : "${GAT_EDGE_ARGS:=--dry-run}" "${SMALL_ARGS:=--dry}"
    : "${PRODUCTS_ARGS:=--nodes 3000 --budget 200MiB --steps 2}"
    : "${HOST_STEP_ARGS:=--scale 0.002}" "${HOST_ARGS:=--steps 5 --warmup 3 --nodes 200}"
    : "${GAT_PROBE_ARGS:=--nodes 100 --hidden 8 --features 16 --steps 2}"
    : "${REPLAN_ARGS:=--scale 0.002 --steps 9}"
fi
DEV="${SUITE_DEVICE:-cuda}"
SCALING_BUDGET_GB="${SCALING_BUDGET_GB:-16}"
LARGEST_BUDGET_GB="${LARGEST_BUDGET_GB:-16}"
START=$(date +%s)

# run_stage NAME LIMIT CMD...: run CMD under `timeout LIMIT` (cut to what is left of the
# suite's budget), appending its output to suite.log and a row to the stage table.
run_stage() {
    local name="$1" limit="$2"
    shift 2
    [[ "$SUITE_STAGES" == *" $name "* ]] || return 0
    local left=$((SUITE_BUDGET - ($(date +%s) - START)))
    if ((left < 15)); then
        echo "== $name: skipped, ${left}s left of the suite's ${SUITE_BUDGET}s" | tee -a "$LOG"
        printf '%s\t%s\t%s\t%s\n' "$name" "skipped" "0" "$*" >>"$STAGES"
        return
    fi
    ((limit > left)) && limit=$left
    echo "== $name (limit ${limit}s): $*" | tee -a "$LOG"
    local t0=$(date +%s)
    timeout --signal=TERM --kill-after=10 "$limit" "$@" >>"$LOG" 2>&1
    local rc=$?
    local dt=$(($(date +%s) - t0))
    echo "== $name: exit $rc after ${dt}s" | tee -a "$LOG"
    printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$dt" "$*" >>"$STAGES"
}

{
    echo "== environment"
    date -u +%Y-%m-%dT%H:%M:%SZ
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 || true
    "$PY" -c 'import torch, torch_geometric, sys; print("python", sys.version.split()[0], "torch", torch.__version__, "pyg", torch_geometric.__version__, "cuda", torch.version.cuda, torch.cuda.is_available())' 2>&1 || true
    git rev-parse HEAD 2>/dev/null || echo "git revision unknown"
} >>"$LOG" 2>&1

run_stage cuda_tests "$T_CUDA_TESTS" \
    "$PY" -m pytest -m cuda tests -p no:cacheprovider -rfE --tb=short -q

run_stage quantize "$T_QUANTIZE" \
    "$PY" benchmarks/speed.py quantize --device "$DEV" --json "$OUTDIR/bench_quantize.json" \
    ${QUANTIZE_ARGS:-}

# each configuration runs in its own process (import + graph + steps); 12 of them
run_stage memory "$T_MEMORY" \
    "$PY" benchmarks/memory.py activations --device "$DEV" --timeout 60 --jobs "${MEMORY_JOBS:-3}" \
    --json "$OUTDIR/activation_memory.json" ${MEMORY_ARGS:-}

run_stage step_time "$T_STEP" \
    "$PY" benchmarks/speed.py step --device "$DEV" --warmup 2 --steps 10 \
    --methods "${STEP_METHODS:-stock,L1-4bit,L1-2bit,L1-2bit-adaptive,L2-2bit,stock-amp,L1-2bit-amp}" \
    ${STEP_MODELS:+--models "$STEP_MODELS"} \
    --time-budget $((T_STEP - 25)) --json "$OUTDIR/step_time.json" ${STEP_ARGS:-}

run_stage scaling "$T_SCALING" \
    "$PY" benchmarks/memory.py scaling --device "$DEV" --budget-gb "$SCALING_BUDGET_GB" --rel-tol 0.05 \
    --time-budget $((T_SCALING - 35)) --json "$OUTDIR/scaling.json" ${SCALING_ARGS:-}

run_stage largest "$T_LARGEST" \
    "$PY" benchmarks/largest_graph.py search --device "$DEV" --ceiling-gib "$LARGEST_BUDGET_GB" \
    --rel-tol 0.1 --max-trials 4 --json "$OUTDIR/largest_graph.json" ${LARGEST_ARGS:-}

run_stage replan "$T_REPLAN" \
    "$PY" tests/policy/replan_time.py --device "$DEV" --scale 1 --models gat,gcn --steps 17 \
    ${REPLAN_ARGS:-}

run_stage gat_probe "$T_GAT_PROBE" \
    "$PY" benchmarks/memory.py probe-peak --device "$DEV" --models gat,gatv2 --steps 3 \
    --json "$OUTDIR/gat_probe_peak.json" ${GAT_PROBE_ARGS:-}

run_stage gat_edge "$T_GAT_EDGE" \
    "$PY" benchmarks/speed.py gat-edge --device "$DEV" --json "$OUTDIR/bench_gat_edge.json" \
    ${GAT_EDGE_ARGS:-}

run_stage gatv2_edge "$T_GAT_EDGE" \
    "$PY" benchmarks/speed.py gat-edge --device "$DEV" --op gatv2 ${GAT_EDGE_ARGS:-}

run_stage small "$T_SMALL" \
    "$PY" benchmarks/speed.py epoch --device "$DEV" --json "$OUTDIR/small_graph_epoch.json" \
    ${SMALL_ARGS:-}

run_stage products "$T_PRODUCTS" \
    "$PY" benchmarks/budget.py products --device "$DEV" --hidden 32 --steps 4 \
    --json "$OUTDIR/budget_products.json" ${PRODUCTS_ARGS:-}

for check in forward version; do
    run_stage "host_step_$check" $((T_HOST / 3)) \
        "$PY" benchmarks/speed.py step --device "$DEV" --models gcn --warmup 2 --steps 10 \
        --methods stock,L1-2bit,L1-2bit-adaptive --graph-check "$check" \
        --time-budget $((T_HOST / 3 - 15)) --json "$OUTDIR/step_check_$check.json" \
        ${HOST_STEP_ARGS:-}
done
run_stage host_overhead $((T_HOST / 3)) \
    "$PY" benchmarks/speed.py host --device "$DEV" --model gcn \
    ${HOST_ARGS:---nodes 4000 --edges 20000 --features 128}

# suite.json and SUMMARY.md from what the stages wrote
"$PY" - "$OUTDIR" "$STAGES" "$START" <<'EOF' >>"$LOG" 2>&1
import json, sys, time
from pathlib import Path

import importlib

sys.path.insert(0, ".")
out, stages_file, start = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
stages = []
for line in stages_file.read_text().splitlines():
    name, rc, secs, cmd = line.split("\t", 3)
    stages.append({"stage": name, "exit": rc, "seconds": int(secs), "command": cmd})
log = (out / "suite.log").read_text(errors="replace")
env = log.split("== environment", 1)[-1].split("== ", 1)[0].strip().splitlines()
suite = {"stages": stages, "environment": env, "wall_seconds": int(time.time()) - start}
(out / "suite.json").write_text(json.dumps(suite, indent=1))

parts = ["# GPU benchmark suite", "", "Environment:", "", *[f"    {e}" for e in env], ""]
parts += ["| stage | exit | seconds |", "| --- | --- | ---: |"]
parts += [f"| {s['stage']} | {s['exit']} | {s['seconds']} |" for s in stages]
# the tables of the stages this run ran (file, stage, renderer "module.function", title)
ran = {s["stage"] for s in stages}
renderers = [
    ("activation_memory.json", "memory", "memory.activations_table", "Activation memory"),
    ("step_time.json", "step_time", "speed.step_table", "Step time"),
    ("scaling.json", "scaling", "memory.scaling_table", "Scaling (max depth / width)"),
    ("largest_graph.json", "largest", "largest_graph.table", "Largest graph"),
]
for fname, stage, renderer, title in renderers:
    if stage not in ran:
        continue
    path = out / fname
    parts += ["", f"## {title}", ""]
    if not path.exists():
        parts.append(f"(no {fname}: see suite.log)")
        continue
    try:
        data = json.loads(path.read_text())
        module, function = renderer.split(".")
        table = getattr(importlib.import_module(f"benchmarks.{module}"), function)
        parts += [f"`{data.get('command', '')}`", "", table(data["results"])]
    except Exception as exc:  # keep the raw file; say why the table is missing
        parts.append(f"(could not render {fname}: {type(exc).__name__}: {exc})")
q = out / "bench_quantize.json"
if "quantize" in ran:
    parts += ["", "## Quantize kernels", ""]
    parts.append(f"```\n{q.read_text()[:4000]}\n```" if q.exists() else "(no bench_quantize.json)")
(out / "SUMMARY.md").write_text("\n".join(parts) + "\n")
print("wrote", out / "suite.json", "and", out / "SUMMARY.md")
EOF
rm -f "$STAGES" "$OUTDIR"/*.tmp
echo "== suite done in $(($(date +%s) - START))s; results in $OUTDIR" | tee -a "$LOG"
