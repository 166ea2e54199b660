#!/usr/bin/env bash
# colocate-rl on several machines without Slurm. Run this script on every node (by hand, ssh, pdsh, ...) with
# the same recipe, options and MASTER_ADDR everywhere; only NODE_RANK differs. Each node starts torchrun with
# one rank per GPU; torchrun's c10d rendezvous on MASTER_ADDR:MASTER_PORT joins them.
#
#   MASTER_ADDR=10.0.0.1 NNODES=2 NODE_RANK=0 scripts/multinode.sh RECIPE [train options]   # on 10.0.0.1
#   MASTER_ADDR=10.0.0.1 NNODES=2 NODE_RANK=1 scripts/multinode.sh RECIPE [train options]   # on the other node
#   DRY_RUN=1 MASTER_ADDR=10.0.0.1 NNODES=2 scripts/multinode.sh RECIPE   # or --dry-run: print every node's command
#
# MASTER_ADDR   address of node 0, which hosts the rendezvous (required)
# MASTER_PORT   rendezvous port, open between the nodes (default 29500)
# NNODES        number of nodes (required)
# NODE_RANK     this node, 0 ... NNODES-1 (required unless dry-run)
# RDZV_ID       the job's id, the same on every node; also names the default run dir runs/<name>-<RDZV_ID>, so
#               give each job a new one (default: colocate-rl's default, "colocate-rl")
# RDZV_BACKEND  c10d (default) or static (node rank NODE_RANK is also the torchrun group rank)
# VENV, COLOCATE_RL  a virtual environment to activate first; the command (default colocate-rl)
#
# The run directory is either on a filesystem all nodes share (pass the same --run-dir) or local to each node;
# see docs/guide/cluster.md.
set -euo pipefail

if [ "$#" -lt 1 ]; then
  echo "error: RECIPE: missing; usage: MASTER_ADDR=HOST NNODES=N NODE_RANK=K scripts/multinode.sh RECIPE [options]" >&2
  exit 2
fi
need_number() {  # need_number VAR HINT: VAR must be set to a whole number
  local value="${!1:-}"
  case "$value" in
    '') echo "error: $1: not set; $2" >&2; exit 2 ;;
    *[!0-9]*) echo "error: $1: expected a whole number, got '$value'; $2" >&2; exit 2 ;;
  esac
}
if [ -z "${MASTER_ADDR:-}" ]; then
  echo "error: MASTER_ADDR: not set; give the address of node 0, e.g. MASTER_ADDR=10.0.0.1" >&2
  exit 2
fi
need_number NNODES "give the number of nodes, e.g. NNODES=2"
MASTER_PORT="${MASTER_PORT:-29500}"
need_number MASTER_PORT "give the rendezvous port, e.g. MASTER_PORT=29500"
if [ -n "${VENV:-}" ]; then
  # shellcheck disable=SC1091
  . "$VENV/bin/activate"
fi
read -r -a launcher <<< "${COLOCATE_RL:-colocate-rl}"

dry_run=0
args=()
for arg in "$@"; do
  if [ "$arg" = "--dry-run" ]; then dry_run=1; else args+=("$arg"); fi
done
if [ "${DRY_RUN:-0}" != "0" ]; then dry_run=1; fi

node_command() {  # node_command RANK: the exact command node RANK runs
  local cmd=("${launcher[@]}" train "${args[@]}" --nnodes "$NNODES" --node-rank "$1"
             --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT")
  if [ -n "${RDZV_ID:-}" ]; then cmd+=(--rdzv-id "$RDZV_ID"); fi
  if [ -n "${RDZV_BACKEND:-}" ]; then cmd+=(--set "distributed.rdzv_backend=$RDZV_BACKEND"); fi
  printf '%q ' "${cmd[@]}"
}

if [ "$dry_run" = "1" ]; then
  for ((rank = 0; rank < NNODES; rank++)); do
    echo "# node $rank: $(node_command "$rank")"
  done
  exit 0
fi
need_number NODE_RANK "give this node's rank, 0 ... $((NNODES - 1)), e.g. NODE_RANK=0 on $MASTER_ADDR"
eval "exec $(node_command "$NODE_RANK")"
