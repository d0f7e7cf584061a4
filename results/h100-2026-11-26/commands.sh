# The commands behind the figures in README.md, run from the project root on one H100 80GB
# (torch 2.11.0+cu130; the pinned stack installed beside it with pip install --no-deps -r requirements-host-torch.txt).
B="python3 benchmark.py --use_synth_data --precision amp_bf16 --num_workers 8 --log_interval 1ba"
SX="--use_ema --model_config sdxl-base --precomputed --precomputed_format text_states"
$B $SX --batch_size 32 --device_train_microbatch_size 2 --max_duration 5ba --warmup_batches 2 --results_json sdxl-mb2-step.json
$B $SX --batch_size 32 --device_train_microbatch_size 2 --max_duration 4ba --warmup_batches 2 --weight_casts microbatch --results_json sdxl-mb2-castsmb.json
python3 bench/blocks.py --model_config flux1-schnell --precomputed --json                      # flux-blocks-bf16.log
$B $SX --batch_size 64 --device_train_microbatch_size 32 --activation_checkpointing --max_duration 4ba --warmup_batches 2 --results_json sdxl-ckpt-mb32-step.json
$B --use_ema --model_config sd2-base --image_size 512 --precomputed --batch_size 512 --device_train_microbatch_size 32 --max_duration 5ba --warmup_batches 2 --results_json sd2-pre-step.json
python3 bench/blocks.py --model_config flux1-schnell --precomputed --fp8 tensorwise --json     # flux-blocks-fp8.log
$B --use_ema --model_config sd2-base --image_size 512 --batch_size 256 --device_train_microbatch_size 32 --max_duration 5ba --warmup_batches 2 --results_json sd2-online-step.json
# blocks2.jsonl, one line each:
python3 bench/blocks.py --model_config flux1-schnell --precomputed --activation_checkpointing --json
python3 bench/blocks.py --model_config sdxl-base --precomputed --precomputed_format text_states --activation_checkpointing --use_ema --global_batch 64 --microbatch 32 --gpus 1 --compare_results_json sdxl-ckpt-mb32-step.json --json   # CUDA out of memory
python3 bench/blocks.py --model_config sd2-base --precomputed --use_ema --global_batch 512 --microbatch 32 --gpus 1 --compare_results_json sd2-pre-step.json --json
$B $SX --batch_size 128 --device_train_microbatch_size 32 --activation_checkpointing --max_duration 5ba --warmup_batches 2 --profile_batches 1 --profile_dir prof --results_json sdxl-ckpt-mb32-gb128-prof.json
$B --use_ema --model_config sd2-base --image_size 512 --precomputed --batch_size 512 --device_train_microbatch_size 128 --activation_checkpointing --max_duration 5ba --warmup_batches 2 --results_json sd2-pre-ckpt-mb128.json
