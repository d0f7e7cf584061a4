#!/usr/bin/env bash
# One device call: SDXL's default set-up (auto) eager, measured against the memory count; then the GPU
# report's SDXL compiled row and SD2 precomputed row.
exec > >(tee -a "$OUT/device.log") 2>&1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 || exit 1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/env.txt"
python3 -c "import torch,composer,streaming,diffusers,transformers,torchao; print(torch.__version__, torch.version.cuda, composer.__version__, streaming.__version__, diffusers.__version__, transformers.__version__, torchao.__version__)" >> "$OUT/env.txt"
git rev-parse HEAD >> "$OUT/env.txt"
B="python3 benchmark.py --use_synth_data --precision amp_bf16 --num_workers 8 --log_interval 1ba --use_ema"
SX="--model_config sdxl-base --precomputed --precomputed_format text_states"
date; timeout 180 $B $SX --batch_size 64 --max_duration 5ba --warmup_batches 2 --results_json "$OUT/sdxl-auto-eager.json"
date; timeout 290 python3 bench/gpu_report.py --out /tmp/report --budget_s 270 --rows sdxl-1024-compile sd2-512-precomputed
date; tar czf "$OUT/report.tgz" -C /tmp report
