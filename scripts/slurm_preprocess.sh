#!/bin/bash
# Preprocess a large dataset on a SLURM cluster: one array task per shard, then one packing job.
#
#   bash scripts/slurm_preprocess.sh            (submits both jobs; edit the settings below)
#
# Every task runs the same command on the same --output_dir (a shared filesystem): inside the job
# array, --shard_index defaults to SLURM_ARRAY_TASK_ID (and --num_shards to SLURM_ARRAY_TASK_COUNT;
# it is given here so that a resubmitted subset, --array=3,7, still knows the split), so each task
# encodes its contiguous range of records into output_dir/packed_seq_dataset/part_*. A failed or
# preempted task is resubmitted with --resume and continues from its last checkpoint.
# The final job runs the same command with --num_shards and no shard index: it checks that the
# parts cover every record once with identical settings, joins them (no re-tokenising), packs and
# writes: the same bytes as one run without shards.
set -euo pipefail

SHARDS=${SHARDS:-16}
OUTPUT_DIR=${OUTPUT_DIR:-/shared/llava665k_packed}
COMMAND=(
  neva-pack preprocess
  --data_path /shared/llava_v1_5_mix665k.json
  --image_folder /shared/llava_images
  --tokenizer_path /shared/tokenizer.model
  --output_dir "$OUTPUT_DIR"
  --conv_template v1 --image_aspect_ratio pad
  --hf_vision_encoder openai/clip-vit-large-patch14-336
  --max_seq_length 4096 --packing_algorithm near_optimal
  --quiet
)

# 1. the shards: one array task each (add --resume to resubmit failed tasks: --array=3,7;
#    `neva-pack shards status $OUTPUT_DIR` prints that line for exactly the shards left)
ENCODE_JOB=$(sbatch --parsable --job-name=neva-pack-encode --array=0-$((SHARDS - 1)) \
  --nodes=1 --ntasks=1 --cpus-per-task=32 --time=04:00:00 \
  --wrap="${COMMAND[*]} --num_shards $SHARDS --num_workers 32")

# 2. the final step, once every shard succeeded: join, pack, write (no image work: one small node)
sbatch --job-name=neva-pack-pack --dependency=afterok:"$ENCODE_JOB" \
  --nodes=1 --ntasks=1 --cpus-per-task=4 --time=02:00:00 \
  --wrap="${COMMAND[*]} --num_shards $SHARDS"
