#!/usr/bin/env bash
# Issue 36 (and 34's TPOT re-run) on the GPU machine (.whl/, .vocab/, base36/,
# before34/ and before/ beside the tree as a part needs them): parts, each fitting one call.
#   tests       the sampler's CUDA tests (the Triton sampling kernel, the Sampler end to end, the
#               rejection sampler on CUDA) and the engine tests that sample on CUDA
#   mixed       benchmarks/sampling.py --workloads mixed in base36/ (`git archive <base> foveal benchmarks`)
#               and in this checkout, alternating, one process per tree
#   kernel      the sampler alone: the Triton kernel against the torch path on [256, 128256] logits, and
#               the logprobs' pass alone (logprobs_ms), the mixed rows with penalties (penalties_bf16_ms)
#   kernel_ab   the same in before/ and here, alternating (before/ beside the tree holds the base's foveal
#               and this checkout's benchmarks: `mkdir before && git archive <base> foveal | tar -x -C
#               before && git archive HEAD benchmarks | tar -x -C before`)
#   tiles       the Triton kernel alone at several (column block, warps per program) shapes
#   tile_pick   tiles over SAMPLING_TILES (the decode step's case: bf16 mixed rows with penalties), then
#               the mixed workload at the default shape and at the sweep's fastest for that case
#   filters     the Triton kernel alone with all rows on one filter each (fp32 / bf16 logits): its time by filter
#   decode      mixed --reps 1 --profile: decode steps of both modes timed, then traced ($OUT/prof)
#   prefix      the shared-prefix workload, this checkout only (plain and shared-prefix decode alternating)
#   prefix_sweep  rows x prefix lengths, decode step with the shared-prefix kernel off and on (the rule)
#   structured  benchmarks/structured.py (JSON schema vs free TPOT, batch 1 and 64) here and in before34/
#   eagle       benchmarks/speculative.py --heads eagle3 batch 1 with --profile, here and in before/
#   dflash      the same for DFlash at batch 1 and 64 (issue 35's before/after; DFLASH_PROFILE=1: traces)
#   rows        EAGLE-3 and DFlash at batch 64 (drafts forced accepted), a request's verify and block rows
#               read plainly (request_rows_min_tokens 0) and once a request (256), alternating in one engine
# Usage: FOVEAL_COMMIT=$(git rev-parse --short HEAD) bash scripts/sampling_device.sh tests mixed
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/device_env.sh
R=$PWD
OUT=${OUT:-/tmp/out}
quiet() { grep -v " INFO \|^\[transformers\]\|USDT\|^$"; }
in_tree() {  # in_tree DIR COMMIT CMD...: run CMD from DIR with that tree's foveal on the path
  local d=$1 c=$2; shift 2
  (cd "$d" && PYTHONPATH=/tmp/site:$PWD FOVEAL_COMMIT=$c "$@")
}
for part in "$@"; do
  echo "=== $part $(date -u +%H:%M:%S)"
  case $part in
    tests)
      timeout ${T_TESTS:-200} python3 -m pytest -q -p no:cacheprovider tests/test_sample_kernel.py \
        tests/test_sampler.py tests/test_spec_verify.py tests/test_engine.py tests/test_async_scheduling.py \
        tests/test_cuda_graphs.py -k "not real_model" 2>&1 | tail -8
      ;;
    mixed)
      for i in $(seq ${N_MIXED:-2}); do
        for t in base after; do
          d=$R; c=$FOVEAL_COMMIT; [ $t = base ] && d=$R/base36 && c=base36
          echo "-- $t $i"
          in_tree "$d" "$c" timeout ${T_MIXED:-150} python3 benchmarks/sampling.py --workloads mixed --reps 1 \
            2>&1 | quiet | grep -v '^{' | tail -3
        done
      done
      ;;
    kernel)
      timeout ${T_KERNEL:-150} python3 benchmarks/sampling.py --workloads kernel 2>&1 | quiet | grep -v '^{' | tail -3
      ;;
    kernel_ab)  # the kernel workload in before/ and here, alternating (each tree's own foveal)
      for i in 1 2; do
        for t in before after; do
          d=$R; c=$FOVEAL_COMMIT; [ $t = before ] && d=$R/before && c=before
          echo "-- $t $i"
          in_tree "$d" "$c" timeout ${T_KERNEL:-120} python3 benchmarks/sampling.py --workloads kernel 2>&1 \
            | quiet | grep -v '^{' | tail -3
        done
      done
      ;;
    tiles)
      timeout ${T_TILES:-150} python3 benchmarks/sampling.py --workloads tiles 2>&1 | quiet | grep -v '^{' | tail -14
      ;;
    tile_pick)
      timeout ${T_TILES:-200} python3 benchmarks/sampling.py --workloads tiles > $OUT/tiles.txt 2>&1
      grep '^kernel' $OUT/tiles.txt | sed 's/ INFO [^:]*://' | cut -c1-400
      best=$(grep '^{' $OUT/tiles.txt | python3 -c "
import json, re, sys
r = json.loads(sys.stdin.read())['tiles']
case = {k[:-len(' bf16 + penalties, heavy first')]: v for k, v in r.items() if k.endswith('penalties, heavy first')}
s = min(case, key=case.get)
m = re.match(r'block (\d+) warps (\d+) lanes (\d+)(?: regs <= (\d+))?', s)
print(','.join(g or '0' for g in m.groups()))")
      echo "-- fastest for the decode step's case: $best"
      for tile in "" "$best"; do
        echo "-- mixed, shape ${tile:-default}"
        SAMPLING_TILE=$tile timeout ${T_MIXED:-200} python3 benchmarks/sampling.py --workloads mixed --reps 2 2>&1 \
          | quiet | grep -v '^{' | tail -4
      done
      ;;
    filters)
      timeout ${T_FILTERS:-150} python3 benchmarks/sampling.py --workloads filters 2>&1 | quiet | grep -v '^{' | tail -32
      ;;
    decode)
      timeout ${T_DECODE:-200} python3 benchmarks/sampling.py --workloads mixed --reps 1 --profile $OUT/prof 2>&1 \
        | grep '^{"profile\|mixed / greedy\|decode step greedy' | cut -c1-1500
      gzip -f $OUT/prof/*.json 2>/dev/null
      ;;
    prefix)
      timeout ${T_PREFIX:-200} python3 benchmarks/sampling.py --workloads prefix --reps 2 2>&1 | quiet | tail -3
      ;;
    prefix_sweep)
      timeout ${T_SWEEP:-400} python3 benchmarks/sampling.py --workloads prefix_sweep 2>&1 | quiet | grep "prefix sweep"
      ;;
    structured)
      for t in after before; do
        d=$R; c=$FOVEAL_COMMIT; [ $t = before ] && d=$R/before34 && c=24c58ca
        echo "-- $t"
        in_tree "$d" "$c" timeout ${T_STRUCT:-250} python3 benchmarks/structured.py --schemas $R/.vocab/heldout \
          --model benchmarks/configs/llama-3.1-8b.json --load-format dummy --tokenizer $R/.vocab/llama3 \
          --batches 1,64 --max-tokens 256 --repeats 1 2>&1 | quiet | tail -4
      done
      ;;
    eagle)
      for t in after before; do
        d=$R; c=$FOVEAL_COMMIT; [ $t = before ] && d=$R/before && c=8a3854b
        echo "-- $t"
        in_tree "$d" "$c" timeout ${T_EAGLE:-230} python3 benchmarks/speculative.py --heads --methods eagle3 \
          --batches 1 --reps 3 --kv-memory-gib 6 --profile $OUT/prof_$t > $OUT/eagle_$t.txt 2>&1
        quiet < $OUT/eagle_$t.txt | grep '^{' | cut -c1-700
      done
      ;;
    dflash)
      for t in after before; do
        d=$R; c=$FOVEAL_COMMIT; [ $t = before ] && d=$R/before && c=8a3854b
        echo "-- $t"
        in_tree "$d" "$c" timeout ${T_DFLASH:-250} python3 benchmarks/speculative.py --heads --methods dflash \
          --batches ${DFLASH_BATCHES:-1,64} --reps ${DFLASH_REPS:-2} --kv-memory-gib 6 \
          ${DFLASH_PROFILE:+--profile $OUT/prof_dflash_$t} > $OUT/dflash_$t.txt 2>&1
        quiet < $OUT/dflash_$t.txt | grep '^{' | cut -c1-900
        gzip -f $OUT/prof_dflash_$t/*.json 2>/dev/null
      done
      ;;
    rows)
      timeout ${T_ROWS:-500} python3 benchmarks/speculative.py --heads --methods ${ROWS_METHODS:-eagle3,dflash} \
        --batches ${ROWS_BATCHES:-64} --reps ${ROWS_REPS:-2} --kv-memory-gib 6 --request-rows 0,256 \
        > $OUT/rows.txt 2>&1
      quiet < $OUT/rows.txt | grep '^{' | cut -c1-700
      ;;
  esac
done
