#!/usr/bin/env bash
# moe_vs_torchtitan.sh - meshtrain against torchtitan 0.3.0 on identical MoE work on CPU, in interleaved rounds
# (torchtitan, then ours, layout by layout): the same model (Qwen3's debugmodel_moe or DeepSeek-V3's debugmodel),
# tokenizer and data (torchtitan_cpu.sh's assets), seq, batch, fp32, AdamW, no activation checkpointing.
# Prints one JSON line: per layout, each side's global tokens/s per round, medians and our ratio.
#
# Settings (env): FAMILY=qwen3|deepseek_v3  LAYOUTS="ws1 fsdp2" (also ep2: FSDP 2 with expert parallel 2)  ROUNDS=2  STEPS=6  SKIP=2  SEQ=256  LBS=2
#   PEERS=../shared/bench (torchtitan_cpu.sh's folder)
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PEERS=${PEERS:-$ROOT/../shared/bench}
FAMILY=${FAMILY:-qwen3}
LAYOUTS=${LAYOUTS:-"ws1 fsdp2"}
ROUNDS=${ROUNDS:-2}
STEPS=${STEPS:-6}
SKIP=${SKIP:-2}
SEQ=${SEQ:-256}
LBS=${LBS:-2}
ASSETS=${ASSETS:-$HOME/.cache/meshtrain-peers/tt_assets}
case $FAMILY in
  qwen3) FLAVOR=debugmodel_moe; TT_CONFIG=qwen3_moe_debug ;;
  deepseek_v3) FLAVOR=debugmodel; TT_CONFIG=deepseek_v3_debugmodel ;;
  *) echo "FAMILY=$FAMILY: expected qwen3 or deepseek_v3" >&2; exit 2 ;;
esac
declare -A OURS_ARGS=([ws1]="one" [fsdp2]="fsdp2" [ep2]="ep2")
results=$(mktemp)
for round in $(seq 1 "$ROUNDS"); do
  for layout in $LAYOUTS; do
    tt=$(STEPS=$STEPS SKIP=$SKIP SEQ=$SEQ LBS=$LBS CONFIGS=$layout MODULE=$FAMILY TT_CONFIG=$TT_CONFIG \
         bash "$PEERS/torchtitan_cpu.sh" 2>/dev/null | tail -1)
    tt_tps=$(python3 -c "import json,sys; r=json.loads(sys.argv[1])['results']['$layout']; print(r['global_tokens_per_s'])" "$tt")
    ours=$(cd "$ROOT" && python3 bench/trainer_throughput.py --layouts "${OURS_ARGS[$layout]}" --repeats 1 \
           --steps "$STEPS" --warmup "$SKIP" --batch "$LBS" --seq "$SEQ" --train-args \
           "--model.name $FAMILY --model.flavor $FLAVOR --model.hf_assets_path $ASSETS/tokenizer --training.dataset_path $ASSETS/c4_test --model.vocab_size 2048 --activation_checkpoint.mode none --lr_scheduler.warmup_steps 2" | tail -1)
    ours_tps=$(python3 -c "import json,sys; d=json.loads(sys.argv[1]); print(list(d['global_tok_s'].values())[0])" "$ours")
    echo "$round $layout $tt_tps $ours_tps" | tee -a "$results" >&2
  done
done
python3 - "$results" "$FAMILY" "$SEQ" "$LBS" <<'PY'
import json, statistics, sys
rows = [line.split() for line in open(sys.argv[1])]
out = {"bench": "moe_vs_torchtitan", "family": sys.argv[2], "seq": int(sys.argv[3]), "local_batch": int(sys.argv[4]), "layouts": {}}
for layout in dict.fromkeys(r[1] for r in rows):
    tt = [float(r[2]) for r in rows if r[1] == layout]
    ours = [float(r[3]) for r in rows if r[1] == layout]
    out["layouts"][layout] = {"torchtitan": tt, "meshtrain": ours, "median_torchtitan": statistics.median(tt),
                              "median_meshtrain": statistics.median(ours),
                              "ratio": round(statistics.median(ours) / statistics.median(tt), 2)}
print(json.dumps(out))
PY
