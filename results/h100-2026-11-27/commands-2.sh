#!/usr/bin/env bash
exec > >(tee -a "$OUT/device.log") 2>&1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 || exit 1
git rev-parse HEAD > "$OUT/env.txt"; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >> "$OUT/env.txt"
timeout 60 python3 results/h100-2026-11-27/conv_check.py
B="python3 benchmark.py --use_synth_data --precision amp_bf16 --num_workers 8 --log_interval 1ba --use_ema"
SX="--model_config sdxl-base --precomputed --precomputed_format text_states"
date; timeout 200 $B $SX --batch_size 64 --max_duration 5ba --warmup_batches 2 --results_json "$OUT/sdxl-auto-eager-headroom.json"
date; timeout 200 $B $SX --batch_size 64 --activation_checkpointing on --device_train_microbatch_size 64 --max_duration 5ba --warmup_batches 2 --results_json "$OUT/sdxl-mb64-oom-fallback.json"
date
