#!/usr/bin/env bash
# Issue 28's open measurements on one H200, in order of need, in the background (one device session is ~30 min, so
# the first stages matter most; c256 and c4e ran in invocation M, learn's seeds 0 and 2 and d256 in N, d256 with MPS
# in O, d256 under `generation.mps` and gputest (its default-plan test failed on its own output check, since fixed) in
# P, d2e in R, 2026-12-05). From a copy of the repository on the GPU machine with the GPU stack installed and
# the real model unpacked (../shared/device/stage.sh and ../shared/real-model/build.sh say how):
#   (setsid nohup bash benchmarks/overlap_session.sh > /tmp/go.log 2>&1 &)
# then poll /tmp/res/progress (one line per stage and one JSON row per run) and copy /tmp/res back at every poll:
# the machine can be taken back at any time. STAGES="c256 gen" runs only those; M (the SmolLM2-135M-Instruct
# directory) defaults to where the real-model unpack puts it, D (the GSM8K-style jsonl) to data/ here (copy
# ../shared/real-model/data there); results go to R (/tmp/res), run directories to RUNS (/tmp/runs);
# D256_ORDER and GPUTEST_K change d256's order and gputest's -k; EXTRA=--dry-run makes the drivers print their
# commands and run nothing.
# Stages:
#   learn   held-out learning (arith, 100 steps) with overlap (two engine processes, auto's count), seeds 1 and 3 at
#           once (--concurrent): N ran seeds 0-3 with and without overlap, and overlap's seeds 1 and 3 ran out of GPU
#           memory at start-up (eight runs at once; the driver now starts four at a time)
#   d256    the 1.7B shape through colocate-rl's own `generation.mps: on` (O measured the driver's own daemon: 4.62
#           s/step against 5.39 without MPS and 9.85 for TRL at 32 x 8 without checkpointing, 2.13x), A-B-A-B with
#           TRL and overlap without MPS
#   c256    another invocation of overlap against TRL hand-tuned, A-B-A-B (pooled 2.74x in L, 2.60x in M; C256_ORDER
#           changes the order, e.g. overlap,trl,overlap-4e,overlap,trl,overlap-4e as in M)
#   c4e     four engine processes against two on c256 (not in the default stages: in M four ran 2.21 s/step twice,
#           slower than two, the trainer beside them the limit)
#   gen     standalone vLLM on c256's batches: with logprobs (as the run), without, and without plus a prefill
#           rescoring of prompt + completion for the sampled tokens' logprobs, the two logprobs compared
#   d2e     the 1.7B shape with two engine processes under MPS against TRL and one engine process under MPS,
#           A-B-C-A-B-C (D2E_ORDER changes it). In R two were no faster (4.90 / 4.92 s/step against one's 4.81 / 4.69:
#           each engine's half batch took as long as one engine's whole), so auto keeps one there
#   prio    the 1.7B shape under MPS with the engine process at a higher MPS client priority than the trainer
#           (overlap-prio-mps) A-B-A-B against TRL first (the 2x target), then the trainer capped at 75 % of the
#           SMs (overlap-cap-mps) and both as in O, P, R (overlap-mps) once each (PRIO_ORDER changes it; should prio
#           win, overlap-2e-prio-mps next: two engine processes at the higher priority). Not yet run: no H200 could
#           be had in 2026-12-05's last three sessions. Ran in S: priority alone sped the engine up (3.0-3.2 s a
#           batch) but slowed training (4.3-4.7 s): 5.12 s/step; the cap slowed training and not the engine: 4.79
#   balance the 1.7B shape under MPS, engine first in priority but on at most 50 or 70 % of the SMs, A-B-C-A-B-C
#           against TRL (BALANCE_ORDER changes it)
#   gputest the GPU tests of overlap under colocate-rl's own MPS daemon, of overlap on the real model, and of the
#           default plan (overlap auto)
# vmstat throughout.
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD HF_HUB_OFFLINE=1
R=${R:-/tmp/res}
RUNS=${RUNS:-/tmp/runs}
mkdir -p $R
M=${M:-/tmp/real-model/smollm2-135m-instruct}
D=${D:-$PWD/data/gsm_symbolic_train.jsonl}
STAGES=${STAGES:-gputest d256 learn c256 gen}
stage() { echo "== $1 $(date +%T)" >> $R/progress; }
[ -n "${EXTRA:-}" ] || (setsid nohup vmstat -t 1 > $R/vmstat.txt 2>&1 &)
B="python benchmarks/bench_overlap.py ${EXTRA:-} --model $M --set output.save_model=false"
for st in $STAGES; do
  stage "$st"
  case $st in
    learn) $B --out $RUNS/learn --workload arith --steps 100 --order overlap --seeds 1,3 --concurrent \
             > $R/learn.log 2>&1 ;;
    d256) $B --data "$D" --out $RUNS/d256 --workload d256 --steps 8 --timeout 500 \
            --order "${D256_ORDER:-overlap-mps,trl-mb32,overlap,overlap-mps,trl-mb32,overlap}" \
            > $R/d256.log 2>&1 ;;
    c256) $B --data "$D" --out $RUNS/c256 --workload c256 --steps 12 --timeout 400 \
            --order "${C256_ORDER:-overlap,trl,overlap,trl}" > $R/c256.log 2>&1 ;;
    c4e) $B --data "$D" --out $RUNS/c256 --workload c256 --steps 12 --timeout 400 \
           --order overlap-4e,overlap > $R/c4e.log 2>&1 ;;
    gen) python benchmarks/bench_generation.py ${EXTRA:-} --out $RUNS/gen --devices 0 --timeout 480 --workloads c256 \
           --model "$M" --data "$D" --stages colocated,same --variants trl,lean,rescore > $R/gen.log 2>&1
         cp $RUNS/gen/standalone/*.json $RUNS/gen/*.md $R/ 2>/dev/null ;;
    d2e) $B --data "$D" --out $RUNS/d256 --workload d256 --steps 8 --timeout 500 \
           --order "${D2E_ORDER:-overlap-2e-mps,trl-mb32,overlap-mps,overlap-2e-mps,trl-mb32,overlap-mps}" \
           > $R/d2e.log 2>&1 ;;
    prio) $B --data "$D" --out $RUNS/d256 --workload d256 --steps 8 --timeout 500 \
            --order "${PRIO_ORDER:-overlap-prio-mps,trl-mb32,overlap-prio-mps,trl-mb32,overlap-cap-mps,overlap-mps}" \
            > $R/prio.log 2>&1 ;;
    balance) $B --data "$D" --out $RUNS/d256 --workload d256 --steps 8 --timeout 500 \
               --order "${BALANCE_ORDER:-overlap-prio-ecap50-mps,overlap-prio-ecap70-mps,trl-mb32,overlap-prio-ecap50-mps,overlap-prio-ecap70-mps,trl-mb32}" \
               > $R/balance.log 2>&1 ;;
    gputest) REAL_MODEL_DIR=$M REAL_DATA_DIR=$(dirname "$D") GPU_FIGURES=$R OVERLAP_ORDER=one_step,off \
               python -m pytest -m gpu -s -q tests/test_gpu.py \
               -k "${GPUTEST_K:-own_mps_daemon or overlap_on_the_real_model or default_plan_overlaps}" \
               > $R/gputest.log 2>&1 ;;
    *) echo "unknown stage $st" >> $R/progress ;;
  esac
  grep -h '^{' $R/"$st".log 2>/dev/null | cut -c1-600 >> $R/progress
done
stage done
