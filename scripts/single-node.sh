#!/usr/bin/env bash
# colocate-rl on one machine, never joining other nodes. One rank per visible GPU (or 2 CPU ranks without a GPU);
# it passes --nnodes 1, so a Slurm environment or the recipe's nnodes are ignored.
#
#   scripts/single-node.sh RECIPE [train options]
#   GPUS=0,1 scripts/single-node.sh recipes/gpu-1.5b-layout-zero3.yaml   # only these GPUs
#   DRY_RUN=1 scripts/single-node.sh RECIPE   # or --dry-run: print the command and torchrun's, start nothing
#
# Optional environment: GPUS (becomes CUDA_VISIBLE_DEVICES), VENV (a virtual environment to activate first),
# COLOCATE_RL (the command, default colocate-rl).
set -euo pipefail

if [ "$#" -lt 1 ]; then
  echo "error: RECIPE: missing; usage: scripts/single-node.sh RECIPE [colocate-rl train options]" >&2
  exit 2
fi
if [ -n "${VENV:-}" ]; then
  # shellcheck disable=SC1091
  . "$VENV/bin/activate"
fi
if [ -n "${GPUS:-}" ]; then
  export CUDA_VISIBLE_DEVICES="$GPUS"
fi
read -r -a launcher <<< "${COLOCATE_RL:-colocate-rl}"

dry_run=0
for arg in "$@"; do
  if [ "$arg" = "--dry-run" ]; then dry_run=1; fi
done
if [ "${DRY_RUN:-0}" != "0" ] && [ "$dry_run" = "0" ]; then
  set -- "$@" --dry-run
  dry_run=1
fi

cmd=("${launcher[@]}" train "$@" --nnodes 1)
if [ "$dry_run" = "1" ]; then
  printf '# node 0:%s' "${CUDA_VISIBLE_DEVICES:+ CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES}"
  printf ' %q' "${cmd[@]}"
  echo
fi
exec "${cmd[@]}"
