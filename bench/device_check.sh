#!/usr/bin/env bash
# One short script for a lent GPU (NVIDIA, CUDA build of torch): NCCL world size 1 through run_train.sh,
# a bf16 step of the 1B flavor with tok/s and MFU, and the CUDA-only paths (pinned async checkpoint
# staging, memory snapshot, mixed precision, float8 matmuls). Prints one line per check and a JSON summary last;
# exits non-zero if any check fails. About 3-5 minutes on an H100/H200.
#   bash bench/device_check.sh [OUT_DIR]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-${OUT:-/tmp/meshtrain-device}}
mkdir -p "$OUT"
python -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name(0))" || exit 1
declare -A RESULT
check() {  # name, then the command; its output goes to $OUT/<name>.log
  local name=$1; shift
  local start=$SECONDS
  if "$@" >"$OUT/$name.log" 2>&1; then RESULT[$name]="ok"; else RESULT[$name]="FAILED (exit $?)"; fi
  echo "$name: ${RESULT[$name]} in $((SECONDS - start)) s; last line: $(tail -n 1 "$OUT/$name.log" | cut -c1-200)"
}
# 1. the default job on one GPU: NCCL world of one, debug model, mixed precision via autocast
check nccl_world1 env NGPU=1 ./run_train.sh --training.steps 10 --job.dump_folder "$OUT/debug"
# 2. the 1B flavor in bf16 (byte tokenizer padded to the Llama 3 vocabulary; embedded corpus): tok/s and MFU
check bf16_1b env NGPU=1 CONFIG_FILE=configs/llama3_1b.toml ./run_train.sh --model.tokenizer_path "" \
  --training.dataset embedded --training.steps 12 --training.seq_len 2048 --training.local_batch_size 4 \
  --metrics.log_freq 1 --metrics.enable_tensorboard false --checkpoint.enable false --job.dump_folder "$OUT/1b"
# 3. CUDA-only paths: async checkpoint (pinned staging) and a memory snapshot, then a resume from it
check cuda_paths env NGPU=1 ./run_train.sh --training.steps 4 --checkpoint.enable --checkpoint.interval 2 \
  --checkpoint.async_mode async --checkpoint.last_save_model_only false --profiling.enable_memory_snapshot \
  --profiling.profile_freq 2 --job.dump_folder "$OUT/paths"
check cuda_resume env NGPU=1 ./run_train.sh --training.steps 6 --checkpoint.enable --checkpoint.interval 2 \
  --checkpoint.last_save_model_only false --job.dump_folder "$OUT/paths"
# 4. the CUDA tests of the suite (those that skip on CPU)
check cuda_tests python -m pytest -q -x tests/dtensor/ops/test_attention.py tests/dtensor/test_device_mesh.py \
  tests/trainer/test_metrics.py tests/context_parallel/test_ring_attention.py tests/models/test_float8.py
# 5. float8 linears on the 1B flavor (sm_89+: torch._scaled_mm on the tensor cores), tok/s beside check 2's
check float8_1b env NGPU=1 CONFIG_FILE=configs/llama3_1b.toml ./run_train.sh --model.tokenizer_path "" \
  --training.dataset embedded --training.steps 12 --training.seq_len 2048 --training.local_batch_size 4 \
  --metrics.log_freq 1 --metrics.enable_tensorboard false --checkpoint.enable false --job.dump_folder "$OUT/1b_f8" \
  --model.converters float8 --quantize.linear.float8.filter_fqns output
TOKS=$(grep -o "step 12 |.*" "$OUT/bf16_1b.log" | tail -n 1)
TOKS_F8=$(grep -o "step 12 |.*" "$OUT/float8_1b.log" | tail -n 1)
python - "$OUT" "$TOKS" "$TOKS_F8" <<'PY'
import json, sys
def fields(line):
    return dict(part.strip().split(" ", 1) for part in line.split("|")[1:] if " " in part.strip())
print(json.dumps({"out": sys.argv[1], "bf16_1b_step12": fields(sys.argv[2]), "float8_1b_step12": fields(sys.argv[3])}))
PY
for name in "${!RESULT[@]}"; do [ "${RESULT[$name]}" = ok ] || exit 1; done
