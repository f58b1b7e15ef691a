#!/usr/bin/env bash
# One CPPO training step of the Qwen2.5-1.5B GSM8K recipe on ONE GPU, through veRL 0.9.1's
# default V1 trainer, to check the plugin end to end (rollout -> reward -> CPPO pruning ->
# old/ref log-probs -> cppo advantages -> actor update) where a GPU exists.
#
#   bash scripts/verl_gpu_smoke.sh [MODEL] [DATA_DIR]
#     MODEL     HF id or local path (default Qwen/Qwen2.5-1.5B-Instruct)
#     DATA_DIR  where gsm8k/{train,test}.parquet are or will be written (default ~/data)
#
# Needs: a CUDA machine with veRL's GPU stack (pip install "verl[vllm]==0.9.1" per veRL's
# docs) and this package (pip install -e .), network access to the HF hub the first time
# (model + openai/gsm8k), or both available locally. Not run in CI (no GPU there).
# Passes when the step finishes and veRL's logger printed the cppo/* metrics with the
# expected kept count; exits non-zero otherwise.
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${1:-Qwen/Qwen2.5-1.5B-Instruct}
DATA_DIR=${2:-$HOME/data}
PY=${PYTHON:-python}
LOG=${LOG:-outputs/verl_gpu_smoke.log}
mkdir -p "$(dirname "$LOG")" "$DATA_DIR/gsm8k"

if [[ ! -f "$DATA_DIR/gsm8k/train.parquet" ]]; then
  # veRL's GSM8K format (as its examples/data_preprocess/gsm8k.py writes it)
  "$PY" - "$DATA_DIR/gsm8k" <<'PYEOF'
import re, sys
import datasets
out = sys.argv[1]
instruction = 'Let\'s think step by step and output the final answer after "####".'
def convert(split):
    def fn(ex, idx):
        answer = re.search(r"#### (\-?[0-9\.\,]+)", ex["answer"]).group(1).replace(",", "")
        return {
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": ex["question"] + " " + instruction}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": answer},
            "extra_info": {"split": split, "index": idx},
        }
    return fn
ds = datasets.load_dataset("openai/gsm8k", "main")
for split in ("train", "test"):
    ds[split].map(convert(split), with_indices=True, remove_columns=ds[split].column_names).to_parquet(f"{out}/{split}.parquet")
PYEOF
fi

# 4 prompts before allocation -> 32 prompts x 16 = 512 completions, 64 kept (k=2 of 16)
"$PY" -m cppo_megatron.integrations.verl.main recipes/verl/qwen2.5-1.5b-gsm8k-cppo.yaml \
  data.train_files="$DATA_DIR/gsm8k/train.parquet" data.val_files="$DATA_DIR/gsm8k/test.parquet" \
  actor_rollout_ref.model.path="$MODEL" \
  data.train_batch_size=4 actor_rollout_ref.actor.ppo_mini_batch_size=4 \
  actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8 \
  data.max_response_length=256 \
  actor_rollout_ref.rollout.gpu_memory_utilization=0.4 \
  trainer.n_gpus_per_node=1 trainer.nnodes=1 \
  trainer.total_training_steps=1 trainer.val_before_train=False trainer.test_freq=-1 \
  trainer.logger='["console"]' 2>&1 | tee "$LOG"

grep -q "cppo/num_kept:64" "$LOG" || { echo "smoke: cppo/num_kept:64 not in the log ($LOG)" >&2; exit 1; }
grep -q "cppo/num_completions:512" "$LOG" || { echo "smoke: cppo/num_completions:512 not in the log" >&2; exit 1; }
echo "smoke: one CPPO step ran; cppo/* metrics:"
grep -o "cppo/[a-z_]*:[-0-9.e]*" "$LOG" | sort -u
