# The commands behind the second session's figures (README.md), run from the project root on one H100 80GB at
# commit 6f90821 (the 3% headroom, the 5% reserve and the OOM fallback in place).
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > env.txt
python3 results/h100-2026-11-27/conv_check.py   # bf16 weight gradient of a 3x3 stride-2 conv on a 1x1 map, CUDA
B="python3 benchmark.py --use_synth_data --precision amp_bf16 --num_workers 8 --log_interval 1ba --use_ema"
SX="--model_config sdxl-base --precomputed --precomputed_format text_states"
# SDXL's default set-up with the headroom:
$B $SX --batch_size 64 --max_duration 5ba --warmup_batches 2 --results_json sdxl-auto-eager-headroom.json
# Forced past the limit: microbatch 64 with checkpointing, the OOM fallback to 32:
$B $SX --batch_size 64 --activation_checkpointing on --device_train_microbatch_size 64 --max_duration 5ba \
  --warmup_batches 2 --results_json sdxl-mb64-oom-fallback.json
