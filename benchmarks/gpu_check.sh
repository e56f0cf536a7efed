#!/usr/bin/env bash
# A lent GPU's checks in one call, each step under its own time limit so a stuck step leaves the rest
# their time. Every step's log goes to $OUT (or benchmarks/out) as it runs.
#
#   bash benchmarks/gpu_check.sh [STEP ...]     # on the GPU machine, in the repository root; steps run in
#                                               # the order given (default: 1 to 12)
#
# Needs the offline bundle (.whl/, from benchmarks/offline_bundle.sh). The GPU tests' models and the 8B
# shape share FlashInfer's head-dim-128 bf16 kernels, so the JIT (about 2 minutes) is paid once, in step 1.
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/offline_setup.sh || exit 1
out=${OUT:-benchmarks/out}
mkdir -p "$out"
bench=(python3 benchmarks/gpu.py --shape "${SHAPE:-8b}")
decode=("${bench[@]}" --only decode,profile --batches 1,64,256)

step() { # step N SECONDS NAME COMMAND...
  local n=$1 limit=$2 name=$3
  shift 3
  echo "== $n $name: start $(date +%T), limit ${limit}s" | tee -a "$out/summary.txt"
  timeout "$limit" "$@" >"$out/$n-$name.log" 2>&1
  echo "== $n $name: rc=$? end $(date +%T)" | tee -a "$out/summary.txt"
}

run_step() {
  case $1 in
  # graph pieces, multi-step windows and compiled layers on real CUDA graphs and FlashInfer (the JIT runs here)
  1) step 1 300 tests python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_graph_pieces.py \
    tests/test_multi_step.py tests/test_compiled_layers.py ;;
  # issue 34's item 5: bf16 on the 8B shape against HF's own rounding, both backends
  2) step 2 180 fidelity python3 benchmarks/half_precision.py --shape 8b ;;
  # decode against HF generate, and what a step is made of (4 decode steps per scheduling decision: the default)
  3) step 3 200 decode "${decode[@]}" ;;
  # the same with one decode step per scheduling decision
  4) step 4 120 decode-steps1 "${decode[@]}" --skip-hf --engine-option num_scheduler_steps=1 ;;
  # interventions during generation (graph pieces: the default), against the engine alone, HF and nnsight on HF
  5) step 5 200 interventions-pieces "${bench[@]}" --only interventions --batches 32 --repeats 2 ;;
  # the same rows without pieces (traced steps eager)
  6) step 6 150 interventions-eager "${bench[@]}" --only interventions --batches 32 --repeats 2 --skip-hf \
    --engine-option cuda_graph_pieces=false ;;
  # prefill against HF padded batches
  7) step 7 150 prefill "${bench[@]}" --only prefill --batches 1,16,64,256 ;;
  # decode and its profile with the decoder layers compiled inside the captured graphs (an option)
  8) step 8 240 decode-compiled "${decode[@]}" --skip-hf --engine-option compile_decoder_layers=true ;;
  # windows of 8 steps (vLLM's multi-step default) against the default 4
  9) step 9 120 decode-steps8 "${decode[@]}" --skip-hf --engine-option num_scheduler_steps=8 ;;
  # step 3 without HF: the baseline of steps 8 and 9 in a call that skips step 3
  10) step 10 120 decode-default "${decode[@]}" --skip-hf ;;
  # step 10 sampling (temperature 1, top-k 50): a sampled window's steps must not wait for the GPU either
  11) step 11 120 decode-sampled "${decode[@]}" --skip-hf --temperature 1 --top-k 50 ;;
  # what a decode step of the engine alone, the empty trace, one layer saved and steering is made of: the GPU's
  # busy and idle time, launches, host waits, and the engine thread's sections (pieces, handoffs, sampling, copies)
  12) step 12 180 interventions-profile "${bench[@]}" --only interventions --batches 32 --repeats 1 --skip-hf \
    --profile-rows ;;
  *) echo "no step $1" >&2 ;;
  esac
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >>"$out/summary.txt"
for n in "${@:-1 2 3 4 5 6 7 8 9 10 11 12}"; do
  for m in $n; do run_step "$m"; done
done
cat "$out/summary.txt"
