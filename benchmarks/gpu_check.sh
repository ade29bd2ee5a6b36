#!/usr/bin/env bash
# The GPU check: one script, one GPU, at most 8 minutes, nothing fetched from the network.
#
#   bash benchmarks/gpu_check.sh [OUT_DIR]      # default OUT_DIR: benchmarks/results/gpu
#
# Runs, from the repository root, with the jax/flax/optax already installed on the machine:
#   1. topk.py       MSTopK (on GPU: the XLA threshold search) and radix_topk (the XLA radix
#                     select designed for GPUs) vs lax.top_k and one pass, at 25,557,032
#                     (ResNet-50) and 110,000,000 (BERT-base) values, densities 0.01 and 0.001,
#                     Gaussian, heavy-tailed and block-scaled inputs (one process);
#   2. optim.py      the fused optimizers (SGD, LARS, LAMB, AdamW) vs optax on the ResNet-50 and
#                     Transformer-base parameter trees, with the memory-traffic floor;
#   3. step.py       ResNet-50 bfloat16 training throughput (images/s, synthetic data, batch 256,
#                     224 px, one device): plain optax step vs sparsejax's dense and HiTopKComm steps.
# Each part has its own time limit, so one failure or overrun does not lose the others. Writes
# OUT_DIR/{topk,optim,step}.{json,md}, the logs, and OUT_DIR/gpu.md (all tables, with versions).
# step.py needs ml_collections (sparsejax's train package); where it is
# missing and a folder .whl/ of wheels is present, it is installed from there into a temporary folder.
set -u
cd "$(dirname "$0")/.."
out=${1:-benchmarks/results/gpu}
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
start=$(date +%s)

if ! $py -c "import ml_collections" 2>/dev/null && [ -d .whl ]; then
  site=$(mktemp -d)
  $py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" \
    .whl/*.whl && export PYTHONPATH=$PYTHONPATH:$site
fi

{
  echo "# GPU check ($(date -u +%Y-%m-%dT%H:%MZ))"
  echo
  echo '```'
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | head -2
  $py -c "import jax, flax, optax; print('jax', jax.__version__, 'flax', flax.__version__,
'optax', optax.__version__, jax.devices())" 2>&1 | tail -1
  echo '```'
} > "$out/header.md"
cat "$out/header.md"

part() {  # part NAME LIMIT_S COMMAND...
  local name=$1 limit=$2
  shift 2
  echo "== $name (limit ${limit}s)"
  local t0=$(date +%s)
  timeout --signal=INT --kill-after=10 "$limit" "$@" 2>&1 | tee "$out/$name.log"
  local rc=${PIPESTATUS[0]}
  echo "== $name: exit $rc after $(( $(date +%s) - t0 ))s"
  echo "$name exit=$rc seconds=$(( $(date +%s) - t0 ))" >> "$out/status.txt"
}

: > "$out/status.txt"
part topk 150 $py benchmarks/topk.py --sizes 25557032,110000000 --runs 5 --procs 1 \
  --methods mstopk,radix,exact_topk --out "$out/topk.json"
part optim 170 $py benchmarks/optim.py --runs 5 --out "$out/optim.json"
part step 150 $py benchmarks/step.py --batch 256 --size 224 --dtype bfloat16 \
  --warmup 2 --steps 15 --out "$out/step.json"

{
  cat "$out/header.md"
  for name in topk optim step; do
    echo
    echo "## $name"
    echo
    if [ -f "$out/$name.md" ]; then cat "$out/$name.md"; else echo "(no result; see $name.log)"; fi
  done
  echo
  echo '```'
  cat "$out/status.txt"
  echo "total $(( $(date +%s) - start ))s"
  echo '```'
} > "$out/gpu.md"
cat "$out/gpu.md"
