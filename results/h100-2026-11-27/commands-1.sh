# The commands behind the first session's figures (README.md), run from the project root on one H100 80GB at
# commit d499dad (torch 2.11.0+cu130; the pinned stack installed beside it with pip install --no-deps).
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > env.txt
B="python3 benchmark.py --use_synth_data --precision amp_bf16 --num_workers 8 --log_interval 1ba --use_ema"
SX="--model_config sdxl-base --precomputed --precomputed_format text_states"
# SDXL's default set-up (auto) before the headroom, eager, measured against the memory count:
$B $SX --batch_size 64 --max_duration 5ba --warmup_batches 2 --results_json sdxl-auto-eager.json
# The GPU report's rows (the budget ran out before sdxl-1024-compile):
python3 bench/gpu_report.py --out report --budget_s 270 --rows sdxl-1024-compile sd2-512-precomputed
