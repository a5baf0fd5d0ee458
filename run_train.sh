#!/usr/bin/env bash
# Launch training with torchrun (trainer.launch: torchrun with a one-error failure summary). Every variable has a default, so `./run_train.sh` alone trains the
# debug model: on all local GPUs, or on 2 CPU ranks (gloo) when there is none.
#   NGPU           processes per node (default: GPU count, or 2 without GPUs)
#   CONFIG_FILE    TOML job config (default: this checkout's configs/debug_model.toml)
#   LOG_RANK       ranks whose output is shown, e.g. 0 or 0,1 (default: 0)
#   NNODES, NODE_RANK, RDZV_ENDPOINT   multi-node rendezvous (host:port of node 0)
#   MAX_RESTARTS   torchrun restarts the job this many times after a failure (default 0); with
#                  checkpoint.enable it resumes from the latest committed checkpoint
#   TORCH_CPP_LOG_LEVEL   torch's C++ log level (default ERROR; WARNING shows c10d's connection warnings)
# Extra arguments override the config: ./run_train.sh --training.steps 20
# --estimate: the dry run instead (python -m trainer.estimate, world size NGPU x NNODES): ./run_train.sh --estimate --device h100
set -euo pipefail
# Relative paths (in the arguments and the config: data, tokenizer, dump folder, a CSV schedule) are the
# caller's: the script stays in the caller's directory and runs this checkout's code from wherever it is called.
REPO="$(cd "$(dirname "$0")" && pwd)"
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
for arg in "$@"; do  # every section and key with its type, default and doc (and the dry run's flags); nothing runs
  if [ "$arg" = "--help" ] || [ "$arg" = "-h" ]; then
    if [[ " $* " == *" --estimate "* ]]; then exec python -m trainer.estimate --help; fi
    exec python -m trainer.preflight --help
  fi
done
# GPUs per node, without importing torch (5-15 s): nvidia-smi's list, narrowed to CUDA_VISIBLE_DEVICES
# when it is set (CUDA stops at the first invalid entry, e.g. -1); 0 when there is none.
count_gpus() {
  local n=0 visible=0 id ids
  if command -v nvidia-smi >/dev/null 2>&1; then
    n=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
  fi
  if [ "$n" -gt 0 ] && [ -n "${CUDA_VISIBLE_DEVICES+set}" ]; then
    IFS=, read -ra ids <<< "$CUDA_VISIBLE_DEVICES"
    for id in "${ids[@]}"; do
      id=${id// /}
      [[ -z "$id" || "$id" == -* ]] && break
      visible=$((visible + 1))
    done
    n=$((visible < n ? visible : n))
  fi
  echo "$n"
}
GPUS_HERE=$(count_gpus)
NGPU=${NGPU:-$((GPUS_HERE > 0 ? GPUS_HERE : 2))}  # 2 CPU ranks (gloo) without GPUs
CONFIG_FILE=${CONFIG_FILE:-"$REPO/configs/debug_model.toml"}
LOG_RANK=${LOG_RANK:-0}
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MAX_RESTARTS=${MAX_RESTARTS:-0}
if [ "$NNODES" -eq 1 ]; then
  RDZV=(--standalone)
else
  RDZV=(--rdzv_backend c10d --rdzv_endpoint "${RDZV_ENDPOINT:?set RDZV_ENDPOINT=host:port of node 0}" --node_rank "$NODE_RANK")
  export NODE_RANK  # c10d numbers the nodes its own way; the ranks name this one by NODE_RANK too
fi
export GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-lo}
# torchrun shares its rendezvous store with the workers, and a restarted attempt's gloo rendezvous can
# read the previous attempt's addresses from it ("Gloo connectFullMesh failed ... Connection refused",
# pytorch/pytorch#167288): give every attempt a store of its own.
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}
# c10d's C++ store client logs each broken connection as a warning with ~20 lines of C++ frames (81
# lines when the node hosting the rendezvous goes away); trainer.launch says what went away in one line.
export TORCH_CPP_LOG_LEVEL=${TORCH_CPP_LOG_LEVEL:-ERROR}
if [[ " $* " == *" --estimate "* ]]; then  # the dry run (trainer.estimate): ./run_train.sh --estimate --device h100 [...]
  args=(); for arg in "$@"; do [ "$arg" = "--estimate" ] || args+=("$arg"); done
  NGPU=$NGPU exec python -m trainer.estimate --job.config_file "$CONFIG_FILE" "${args[@]}" --world_size $((NGPU * NNODES))
fi
NGPU=$NGPU NNODES=$NNODES LOG_RANK=$LOG_RANK GPUS_HERE=$GPUS_HERE python -m trainer.preflight --job.config_file "$CONFIG_FILE" "$@" || exit 1  # fail fast, before torchrun
exec python -m trainer.launch --nproc_per_node="$NGPU" --nnodes="$NNODES" "${RDZV[@]}" --max-restarts "$MAX_RESTARTS" \
  --local-ranks-filter "$LOG_RANK" --role rank --tee 3 \
  -m trainer.train --job.config_file "$CONFIG_FILE" "$@"
