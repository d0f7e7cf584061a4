"""The settings of one benchmark.py run: a frozen, typed record made by `t2ibench.commands.checks.validate`
from the parsed flags, and read by every phase of the run (the parsed flags are never changed).
"""
from __future__ import annotations

import argparse
import dataclasses

from t2ibench.datasets.buckets import Bucket
from t2ibench.families import ModelFamily
from t2ibench.datasets.sources import Source


@dataclasses.dataclass(frozen=True)
class Settings:
    """Every flag of benchmark.py under its own name, as validation resolved it, and what validation
    derived from them. A field keeps its flag's name (one name from the command line through the code
    to the results JSON), so where the name carries no unit its comment gives it."""

    # -- the 2023 benchmark's flags
    batch_size: int  # global batch: images per step over all devices
    use_synth_data: bool  # random images and captions
    use_ema: bool  # keep an EMA of the denoiser's weights
    wandb_name: str | None  # W&B run name
    wandb_project: str | None  # W&B project
    device_train_microbatch_size: int | str  # images per device per forward/backward, or "auto"

    # -- data source
    remote: str | None  # --remote as given (several sources joined by commas); `sources` holds them parsed
    local: str | None  # --local as given: a cache folder, shards on disk, or the folder of several caches
    image_key: str  # MDS column of the encoded image bytes
    caption_key: str  # MDS column of the caption text
    cache_limit: str | None  # evict cached shards beyond this size, e.g. "500gb"
    max_bad_fraction: float  # of the images one loader process decoded, failed ones allowed (0 to 1)

    # -- model
    model_config: str  # a key of t2ibench.families.MODEL_CONFIGS
    model_name: str  # hub id or local folder of the pretrained frozen parts (default: the family's)
    image_size: int  # pixels per side (default: the family's training size)
    allow_random_encoders: bool  # go on with random frozen parts when the pretrained ones are missing

    # -- run
    seed: int  # seeds the denoiser's weights, noise, timesteps and data order
    num_workers: int  # DataLoader worker processes per device
    debug: bool  # on an error, also print the traceback

    # -- run length, precision, results
    max_duration: str  # Composer time string (ba, ep or sp)
    precision: str  # as given: "auto" is resolved by runtime.Runtime, which knows the device
    results_json: str | None  # local path of the results JSON
    num_synthetic_samples: int  # samples in the synthetic dataset
    lr: float  # AdamW learning rate
    weight_decay: float  # AdamW weight decay
    warmup_batches: int  # batches left out of the throughput window
    peak_tflops: float | None  # peak TFLOP/s of one device, for MFU
    log_interval: str  # Composer time string (ba or ep) between progress lines in a log file

    # -- streaming (t2ibench.datasets.streaming.StreamingSettings reads these by name)
    shuffle: bool  # False with --no_shuffle
    predownload: int | None  # samples each loader worker downloads ahead
    download_retry: int  # attempts per shard
    download_timeout: float  # seconds per shard download
    validate_hash: str | None  # hash of index.json the downloaded shards are checked with
    shuffle_algo: str  # Streaming's shuffle algorithm
    shuffle_block_size: int | None  # samples per shuffle block
    epoch_size: str | None  # samples per epoch over all sources, e.g. "200m"
    num_canonical_nodes: int | None  # Streaming's canonical nodes
    sampling_granularity: int  # samples taken from a shard at a time

    # -- checkpoints
    save_folder: str | None  # local path (file:// resolved) or object-store URI
    save_interval: str  # Composer time string
    save_num_checkpoints_to_keep: int  # -1: all
    load_path: str | None  # local path (file:// resolved) or URI of a checkpoint
    autoresume: bool  # resume from the latest checkpoint of --save_folder
    run_name: str | None  # Composer's run name

    # -- aspect-ratio buckets
    aspect_buckets: str | None  # as given: None (square), "default" or a file; `buckets` holds the list
    bucket_crop: str  # "random" or "center" (t2ibench.datasets.buckets.CROPS)
    synthetic_bucket_weights: str  # as given: "uniform" or HxW=WEIGHT,...; `bucket_weights` holds them resolved

    # -- speed
    precomputed: bool  # train from latents.py's latents
    precomputed_format: str | None  # synthetic precomputed batches: TOKENS or TEXT_STATES (the family's default)
    channels_last: bool  # denoiser and VAE in channels-last memory format
    compile: bool  # torch.compile every module that runs per step
    norm_precision: str  # norms under AMP: "autocast" or "fp32"
    fsdp: str  # resolved: "none", "shard_grad_op" or "full_shard" (never "auto")
    cpu_threads: int | None  # a CPU run's intra-op threads per rank (None: t2ibench.train.cpu_threads' rule)
    fused_adamw: str  # "auto", "on" or "off"
    xformers: bool  # xFormers attention in the UNet
    weight_casts: str  # as given: "auto" is resolved by runtime.Runtime, which knows the device
    profile_batches: int  # batches profiled after the warm-up
    profile_dir: str  # local folder of the profiler's trace
    activation_checkpointing: str  # as given: "auto" is resolved by runtime.Runtime, which knows the GPU
    fp8: str  # float8 Linear layers: "off" or a scaling (t2ibench.train.fp8.FP8_MODES)

    # -- training recipe
    lr_warmup_batches: int  # linear warm-up, in batches
    lr_schedule: str  # "constant" or "cosine"
    grad_clip_norm: float | None  # clip the gradient's global L2 norm to this
    adamw_beta1: float  # AdamW's beta1, in [0, 1)
    adamw_beta2: float  # AdamW's beta2, in [0, 1)
    adamw_eps: float  # AdamW's epsilon
    caption_drop_prob: float  # probability of the empty caption (0 to 1)
    ema_start: str  # Composer time string (ba, ep or dur)
    ema_half_life: str  # Composer time string in ba
    ema_export_dir: str | None  # local folder of the averaged pipeline
    snr_gamma: float | None  # min-SNR-gamma loss weighting
    offset_noise: float  # offset noise strength (0 to 1)
    loss_bins: int  # bins of timesteps the loss is logged in (0: off)
    timestep_sampling: str  # t2ibench.families.objectives.TIMESTEP_SAMPLINGS

    # -- validation loss
    eval_interval: str | None  # Composer time string (ba or ep), None: no validation loss
    eval_remote: str | None  # as given; `eval_sources` holds the held-out sources parsed
    eval_local: str | None  # as given
    eval_samples: int | None  # held-out samples per evaluation
    eval_target: float | None  # validation loss the run stops at (MLPerf's run stop)
    mlperf_log: str | None  # resolved: local path of the MLPerf log (None: no log)
    mlperf_org: str  # the MLPerf log's submission_org
    mlperf_platform: str | None  # the MLPerf log's submission_platform (None: the run's world size x device)

    # -- FID and CLIP score at each evaluation (t2ibench.eval.image_metrics)
    fid_weights: str | None  # local file: InceptionV3's FID weights or a TorchScript feature extractor
    fid_real_stats: str | None  # local file of the held-out images' FID statistics (read, or written)
    clip_model: str | None  # local transformers CLIP model folder
    image_eval_samples: int | None  # held-out captions drawn per evaluation (None: all the evaluation reads)
    fid_target: float | None  # FID the run stops at or under (with the other targets given)
    clip_target: float | None  # CLIP score (100 x cosine) the run stops at or over

    # -- sample grids
    sample_prompts: str | None  # prompt file or built-in set
    sample_interval: str  # Composer time string (ba or ep)
    samples_dir: str | None  # local folder (default: <save_folder>/samples)
    sample_size: str | None  # as given: HxW, None: square at image_size; `sample_shape` holds it resolved
    sampler: str  # resolved: the family's first sampler unless --sampler names another
    sample_steps: int  # sampler steps per sample
    guidance_scale: float  # classifier-free guidance scale

    # -- derived by validation (no flag of their own)
    family: ModelFamily  # the family of --model_config
    sources: tuple[Source, ...]  # --remote/--local parsed: one per training source, with its cache folder
    eval_sources: tuple[Source, ...]  # --eval_remote/--eval_local parsed (empty without them)
    encoders_seed: int  # seeds random frozen encoders: precompute.json's seed on its latents, else --seed
    buckets: tuple[Bucket, ...]  # --aspect_buckets' list (empty: square images), from checks.check_buckets
    bucket_weights: tuple[float, ...]  # synthetic batches' share per bucket (sum 1), from checks.check_buckets
    sample_shape: Bucket  # samples' height x width in pixels, from checks.check_sample_size

    @classmethod
    def from_args(cls, args: argparse.Namespace, **resolved: object) -> Settings:
        """The parsed flags, with `resolved` in place of the flags' own values and for the derived
        fields. Every flag must have a field and every field a value: a flag added to the parser
        without a field here fails the first run (TypeError), not silently."""
        return cls(**{**vars(args), **resolved})
