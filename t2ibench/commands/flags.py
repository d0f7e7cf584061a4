"""Command-line flags: the groups benchmark.py and latents.py share, checked once (`shared_values`),
and benchmark.py's whole parser (`benchmark_parser`). The parser class is `cli.Parser`.
"""
from __future__ import annotations

import argparse
import math

from t2ibench.core.cli import (BATCH_SIZE, FRACTION, IMAGE_SIZE, NON_NEGATIVE_FLOAT, NON_NEGATIVE_INT, NUMBER_TEXT,
                          POSITIVE_FLOAT, POSITIVE_INT, SECONDS, SEED, Range)
from t2ibench.datasets.buckets import CROPS as BUCKET_CROPS
from t2ibench.datasets.buckets import DEFAULT as DEFAULT_BUCKETS
from t2ibench.datasets.buckets import UNIFORM as UNIFORM_BUCKETS
from t2ibench.core.cli import Parser, check_workers  # noqa: F401 - the commands' parser and its rules, with these groups
from t2ibench.core.errors import fail
from t2ibench.families import MODEL_CONFIGS, ModelFamily, family_of
from t2ibench.train.fp8 import FP8_MODES
from t2ibench.core.locations import DEFAULT_CACHE_ROOT
from t2ibench.train.norms import NORM_PRECISIONS
from t2ibench.families.objectives import TIMESTEP_SAMPLINGS
from t2ibench.train.parallel import FSDP_CHOICES
from t2ibench.train.precision import PRECISION_CHOICES
from t2ibench.datasets.precomputed import TEXT_FORMATS
from t2ibench.eval.sampling import MAX_GUIDANCE_SCALE
from t2ibench.datasets.sources import JoinSources
from t2ibench.datasets.streaming import MAX_BAD_FRACTION, SHUFFLE_ALGOS, StreamingSettings
from t2ibench.train.weight_casts import WEIGHT_CAST_CHOICES

# --activation_checkpointing: auto (t2ibench.commands.gpu_setup's rule on a GPU, off on a CPU), or as given.
ACTIVATION_CHECKPOINTING_CHOICES = ("auto", "on", "off")
# SD2's and SDXL's DDPM schedules have 1000 training timesteps (Flux's are continuous): more loss bins
# than that would stay empty, and more sampler steps than that repeat timesteps.
MAX_LOSS_BINS = MAX_SAMPLE_STEPS = 1000
# Ranges of the recipe and sampling flags that bench/learns.py passes on to benchmark.py.
CAPTION_DROP_PROB = Range(float, 0, 1, high_open=True)
SAMPLE_STEPS = Range(int, 1, MAX_SAMPLE_STEPS)
GUIDANCE_SCALE = Range(float, 0, MAX_GUIDANCE_SCALE)
ADAMW_BETA = Range(float, 0, 1, high_open=True)  # torch.optim.AdamW refuses a beta outside [0, 1)


def add_source(p: argparse.ArgumentParser) -> None:
    """Where the image-caption (or precomputed) MDS shards are, and how to read their samples."""
    g = p.add_argument_group("data source")
    g.add_argument("--remote", type=str, default=None, action=JoinSources,
                   help="MDS shards to stream: s3://, gs://, oci://, ... or a path. Several sources: repeat the flag "
                        "or separate them by commas, each optionally prefixed by its proportion: 0.7=s3://a,0.3=s3://b")
    g.add_argument("--local", type=str, default=None,
                   help=f"cache for --remote (default: {DEFAULT_CACHE_ROOT}/<hash of remote>, one folder per remote "
                        "for every command), or shards already on disk; with several sources, the folder their "
                        "caches go under")
    g.add_argument("--image_key", type=str, default="jpg", help="MDS column holding the encoded image bytes")
    g.add_argument("--caption_key", type=str, default="caption", help="MDS column holding the caption text")
    g.add_argument("--cache_limit", type=NUMBER_TEXT, default=None,
                   help="evict cached shards beyond this size, e.g. 500gb (default: keep all)")
    g.add_argument("--max_bad_fraction", type=FRACTION, default=MAX_BAD_FRACTION,
                   help="stop when more than this fraction of the images one loader process decoded failed "
                        "(checked after 1000)")


def add_model(p: argparse.ArgumentParser) -> None:
    """Which model, and where its pretrained frozen parts come from."""
    g = p.add_argument_group("model")
    g.add_argument("--model_config", type=str, default="sd2-base",
                   help=f"one of {sorted(MODEL_CONFIGS)} (tiny, sdxl-tiny, flux1-tiny: SD2's, SDXL's and Flux.1's "
                        "structure at a few million parameters)")
    g.add_argument("--model_name", type=str, default=None,
                   help="hub id or local diffusers folder with the pretrained VAE, text encoder(s) and tokenizer(s) "
                        "(default: the model's own: stabilityai/stable-diffusion-2-base for SD2, "
                        "stabilityai/stable-diffusion-xl-base-1.0 for SDXL, black-forest-labs/FLUX.1-schnell for Flux)")
    g.add_argument("--image_size", type=IMAGE_SIZE, default=None,
                   help="resolution in pixels, a multiple of 8 (16 for Flux.1) (default: the model's training "
                        "size: 512 for SD2 and Flux.1, 1024 for sdxl-base, 64 for sdxl-tiny)")
    g.add_argument("--allow_random_encoders", action="store_true",
                   help="go on with real data when the pretrained VAE/text encoder cannot be loaded "
                        "(measures throughput; useless for quality)")


def add_fp8(group: argparse._ArgumentGroup) -> None:
    """--fp8: float8 training of the denoiser's Linear layers (t2ibench.train.fp8), for benchmark.py and the
    benchmarks that predict its step (bench/blocks.py)."""
    group.add_argument("--fp8", type=str, default="off", choices=FP8_MODES,
                       help="float8 training of the denoiser's Linear layers whose shapes float8 supports (torchao): "
                            "tensorwise or rowwise scales; the other layers keep the run's precision. Needs a GPU "
                            "of compute capability 8.9 or more; emulated on a CPU (numerics, not speed)")


def add_activation_checkpointing(group: argparse._ActionsContainer, help: str) -> None:
    """--activation_checkpointing auto|on|off (default auto; the bare flag, as before it took a value,
    means on), for benchmark.py and the benchmarks that count its step (bench/memory.py, bench/step_ops.py)."""
    group.add_argument("--activation_checkpointing", type=str, nargs="?", const="on", default="auto",
                       choices=ACTIVATION_CHECKPOINTING_CHOICES, help=help)


def add_run(p: argparse.ArgumentParser, seed_help: str) -> None:
    """Seeds, loader processes and tracebacks."""
    g = p.add_argument_group("run")
    g.add_argument("--seed", type=SEED, default=17, help=seed_help)
    g.add_argument("--num_workers", type=NON_NEGATIVE_INT, default=8, help="DataLoader worker processes per device")
    g.add_argument("--debug", action="store_true", help="on an error, also print the Python traceback")


def add_streaming(p: argparse.ArgumentParser) -> None:
    """The Streaming settings (`streaming.StreamingSettings`), for both real-data loaders."""
    defaults = StreamingSettings()
    g = p.add_argument_group("streaming (both real-data loaders: images and --precomputed)")
    g.add_argument("--no_shuffle", dest="shuffle", action="store_false",
                   help="stream samples in stored order (default: shuffled, seeded by --seed)")
    g.add_argument("--predownload", type=POSITIVE_INT, default=defaults.predownload,
                   help="samples each loader worker downloads ahead (default: 8 x per-device batch)")
    g.add_argument("--download_retry", type=NON_NEGATIVE_INT, default=defaults.download_retry,
                   help="download attempts per shard before failing")
    g.add_argument("--download_timeout", type=SECONDS, default=defaults.download_timeout,
                   help="seconds before a shard download fails")
    g.add_argument("--validate_hash", type=str, default=defaults.validate_hash,
                   help="check downloaded shards with this hash from index.json: sha1 or xxh64")
    g.add_argument("--shuffle_algo", type=str, default=defaults.shuffle_algo, choices=SHUFFLE_ALGOS,
                   help="Streaming's shuffle: py1e (Streaming's default), py1br, py1s, py2s, naive")
    g.add_argument("--shuffle_block_size", type=POSITIVE_INT, default=defaults.shuffle_block_size,
                   help="samples per shuffle block (default: Streaming's, max(4M / canonical nodes, 262144))")
    g.add_argument("--epoch_size", type=NUMBER_TEXT, default=defaults.epoch_size,
                   help="samples per epoch drawn from all sources, e.g. 200000000 or 200m (default: all of them "
                        "once). The epoch's partition takes memory per sample: see docs/scale.md")
    g.add_argument("--num_canonical_nodes", type=POSITIVE_INT, default=defaults.num_canonical_nodes,
                   help="Streaming's canonical nodes, fixing the sample order across node counts (default: the nodes "
                        "of the first run); keep it when resuming on another number of nodes")
    g.add_argument("--sampling_granularity", type=POSITIVE_INT, default=defaults.sampling_granularity,
                   help="with --epoch_size below the dataset: samples taken from a shard at a time when an epoch "
                        "picks part of the data; the samples per shard picks whole shards (no shard downloaded "
                        "for a few samples)")


def add_aspect_buckets(group: argparse._ActionsContainer, what: str) -> None:
    """--aspect_buckets [FILE], for benchmark.py and latents.py (`what`: the command's use of it)."""
    group.add_argument("--aspect_buckets", type=str, nargs="?", const=DEFAULT_BUCKETS, default=None, metavar="FILE",
                       help=f"{what}. The bare flag: the default list at --image_size (SDXL's 41 at 1024); FILE: one "
                            "HEIGHTxWIDTH a line")


def checked_image_size(family: ModelFamily, model_config: str, image_size: int | None) -> int:
    """--image_size, or the family's default where it was left out, checked against the family's
    latent grid (one line naming the flag)."""
    image_size = family.default_image_size(model_config) if image_size is None else image_size
    multiple = family.latent_downsample * family.patch_size
    if image_size % multiple:
        fail(f"--image_size {image_size} must be a positive multiple of {multiple} (the VAE downsamples by "
             f"{family.latent_downsample}" + (f", and latents are cut into {family.patch_size}x{family.patch_size} "
                                              "patches)" if family.patch_size > 1 else ")"))
    return image_size


def shared_values(args: argparse.Namespace) -> tuple[ModelFamily, str, int]:
    """The shared groups' values checked (one line naming the flag for a bad one): the model's family,
    and --model_name and --image_size with the family's defaults where they were left out."""
    family = family_of(args.model_config)
    model_name = family.default_model_name if args.model_name is None else args.model_name
    image_size = checked_image_size(family, args.model_config, args.image_size)
    if args.cache_limit is not None:
        from streaming.base.util import bytes_to_int
        try:
            limit = bytes_to_int(args.cache_limit)
        except (ValueError, TypeError):
            fail(f"--cache_limit {args.cache_limit} is not a size such as 500gb or 20mb")
        if not 0 < limit < math.inf:
            fail(f"--cache_limit {args.cache_limit} must be a positive size such as 500gb")
    return family, model_name, image_size


def benchmark_parser(description: str) -> Parser:
    """benchmark.py's flags; `description` heads its --help."""
    p = Parser("benchmark.py", description=description)
    # The flags of the 2023 benchmark keep their names and defaults (--remote, --local, --image_size
    # and --model_name among the shared groups below).
    g = p.add_argument_group("the 2023 benchmark's flags")
    g.add_argument("--batch_size", type=BATCH_SIZE, default=2048, help="global batch size, images per step over all devices")
    g.add_argument("--use_synth_data", action="store_true", help="random images and captions (measures the model only)")
    g.add_argument("--use_ema", action="store_true",
                   help="keep an EMA of the denoiser's weights (half-life --ema_half_life, 1000 batches)")
    g.add_argument("--wandb_name", type=str, default=None, help="W&B run name (enables W&B logging)")
    g.add_argument("--wandb_project", type=str, default=None, help="W&B project (enables W&B logging)")
    g.add_argument("--device_train_microbatch_size", type=NUMBER_TEXT, default="auto",
                   help="images per device per forward/backward, or 'auto' (GPU: largest that fits, counted with "
                        "--activation_checkpointing auto or on several GPUs; CPU: no accumulation)")
    add_source(p)
    add_model(p)
    add_run(p, "seeds model init, noise, timesteps, data order")
    g = p.add_argument_group("run length, precision, results")
    g.add_argument("--max_duration", type=NUMBER_TEXT, default="1ep", help="Composer time string: 20ba, 1ep, 100000sp")
    g.add_argument("--precision", type=str, default="auto", help=f"one of {PRECISION_CHOICES}; auto: amp_bf16 on GPU, fp32 on CPU")
    g.add_argument("--results_json", type=str, default=None, help="write the throughput summary to this JSON file")
    g.add_argument("--num_synthetic_samples", type=POSITIVE_INT, default=100_000, help="size of the synthetic dataset")
    g.add_argument("--lr", type=POSITIVE_FLOAT, default=1e-4, help="AdamW learning rate (constant unless --lr_schedule / --lr_warmup_batches)")
    g.add_argument("--weight_decay", type=NON_NEGATIVE_FLOAT, default=1e-3, help="AdamW weight decay")
    g.add_argument("--warmup_batches", type=NON_NEGATIVE_INT, default=5, help="batches left out of the throughput measurement")
    g.add_argument("--peak_tflops", type=POSITIVE_FLOAT, default=None,
                   help="peak TFLOP/s of one device for MFU (default: Composer's table for A100/H100/H200)")
    g.add_argument("--log_interval", type=NUMBER_TEXT, default="10ba",
                   help="in a log file, print a progress line this often (20ba, 1ep); on a terminal the line updates in place")
    add_streaming(p)
    g = p.add_argument_group("checkpoints (Composer's: local paths or s3://, gs://, oci://... URIs)")
    g.add_argument("--save_folder", type=str, default=None, help="where to save checkpoints (path or s3://... URI)")
    g.add_argument("--save_interval", type=NUMBER_TEXT, default="1000ba", help="checkpoint every this long (20ba, 1ep)")
    g.add_argument("--save_num_checkpoints_to_keep", type=Range(int, -1), default=-1,
                   help="local checkpoints to keep (-1: all; 0: none, only with an object-store --save_folder, "
                        "which keeps every upload)")
    g.add_argument("--load_path", type=str, default=None, help="checkpoint to start from (path or URI)")
    g.add_argument("--autoresume", action="store_true",
                   help="resume from the latest checkpoint in --save_folder if there is one (needs --run_name)")
    g.add_argument("--run_name", type=str, default=None, help="run name; fixed names let --autoresume find the run")
    g = p.add_argument_group("aspect-ratio buckets (SDXL, Flux.1; docs/data.md#aspect-ratio-buckets)")
    add_aspect_buckets(g, "train on images as they are: each goes to the bucket nearest its aspect ratio, resized to "
                          "cover it and cropped, and every batch holds one bucket (--precomputed: latents stored per "
                          "bucket by latents.py --aspect_buckets, the same list)")
    g.add_argument("--bucket_crop", type=str, default="random", choices=BUCKET_CROPS,
                   help="with --aspect_buckets: where an image is cropped in its bucket, a random corner drawn per "
                        "sample and epoch (SDXL's training) or the center")
    g.add_argument("--synthetic_bucket_weights", type=str, default=UNIFORM_BUCKETS,
                   help="with --use_synth_data --aspect_buckets: how often each bucket's batches come, uniform (every "
                        "bucket of the list alike) or HxW=WEIGHT,... (relative; buckets left out get none)")
    g = p.add_argument_group("speed (defaults: on a GPU the set-up measured fastest, docs/speed.md; on a CPU the "
                             "plain step)")
    g.add_argument("--precomputed", action="store_true",
                   help="train from precomputed VAE latents (latents.py): no VAE; the text encoder runs on stored "
                        "token ids, or is skipped too for shards written with --store_text_states")
    g.add_argument("--precomputed_format", type=str, default=None, choices=TEXT_FORMATS,
                   help="with --precomputed --use_synth_data: the format synthetic batches imitate (shards: read "
                        "from their columns); default tokens for SD2, text_states (MLPerf's) for Flux")
    g.add_argument("--channels_last", action="store_true", help="denoiser and VAE in channels-last memory format")
    g.add_argument("--compile", action="store_true",
                   help="torch.compile every module that runs per step, block by block, each distinct block once: "
                        "the denoiser, and the VAE encoder and text encoders when they run (in place: checkpoint "
                        "keys unchanged); needed by --fp8")
    g.add_argument("--norm_precision", type=str, default="autocast", choices=NORM_PRECISIONS,
                   help="under AMP, GroupNorm and LayerNorm run in the autocast dtype (autocast), or in fp32 as "
                        "CUDA autocast's own lists have them (fp32)")
    g.add_argument("--fsdp", type=str, default="auto", choices=FSDP_CHOICES,
                   help="shard the denoiser's weights, gradients and AdamW state over the ranks (Composer's FSDP2): "
                        "full_shard (weights gathered block by block in forward and again in backward), "
                        "shard_grad_op (gathered once per microbatch, kept until its backward ends); none: DDP; "
                        "auto: full_shard for Flux.1 on several ranks, else none")
    g.add_argument("--cpu_threads", type=POSITIVE_INT, default=None, metavar="N",
                   help="on a CPU: intra-op threads per rank (default: the machine's cores per rank on this node less "
                        "--num_workers, at least 1, whatever its load; OMP_NUM_THREADS where set). A resumed run "
                        "keeps each rank's count of the run it resumes (docs/speed.md#cpu-threads)")
    g.add_argument("--fused_adamw", type=str, default="auto", choices=("auto", "on", "off"),
                   help="fused AdamW kernel; auto: on with CUDA")
    g.add_argument("--xformers", action="store_true", help="use xFormers attention in the UNet (default: PyTorch SDPA)")
    g.add_argument("--weight_casts", type=str, default="auto", choices=WEIGHT_CAST_CHOICES,
                   help="cast the denoiser's weights to bf16 once per optimizer step (step: bf16 copies, fp32 "
                        "weights for the optimizer) or in every microbatch's forward and backward as autocast does "
                        "(microbatch); auto: step on one CUDA device under amp_bf16, else microbatch")
    g.add_argument("--profile_batches", type=Range(int, 0, 1000), default=0,
                   help="profile this many batches right after the warm-up with the torch profiler (left out of "
                        "the throughput window): a trace for Perfetto / chrome://tracing, the 15 most expensive "
                        "ops and the device-busy fraction in the summary and the results JSON")
    g.add_argument("--profile_dir", type=str, default="profile", help="where --profile_batches writes its trace")
    add_activation_checkpointing(
        g, "recompute each block of the denoiser in the backward pass instead of keeping its activations "
           "(diffusers' gradient checkpointing): less memory, about a third more compute. auto: on a GPU, the "
           "largest microbatch that fits without it or the largest with it, whichever is predicted faster "
           "(docs/speed.md); with a given --device_train_microbatch_size, on only when that one does not fit "
           "without it; off on a CPU. The bare flag means on")
    add_fp8(g)
    g = p.add_argument_group("training recipe (every default keeps the 2023 step)")
    g.add_argument("--lr_warmup_batches", type=NON_NEGATIVE_INT, default=0, help="linear learning-rate warm-up over this many batches")
    g.add_argument("--lr_schedule", type=str, default="constant", choices=("constant", "cosine"),
                   help="after the warm-up: constant, or cosine decay to 0 at --max_duration")
    g.add_argument("--grad_clip_norm", type=POSITIVE_FLOAT, default=None, help="clip the gradient's global L2 norm to this")
    g.add_argument("--adamw_beta1", type=ADAMW_BETA, default=0.9, help="AdamW's beta1 (the gradient's running mean)")
    g.add_argument("--adamw_beta2", type=ADAMW_BETA, default=0.999,
                   help="AdamW's beta2 (the squared gradient's running mean; MLPerf Flux.1: 0.95)")
    g.add_argument("--adamw_eps", type=POSITIVE_FLOAT, default=1e-8, help="AdamW's epsilon (added to the denominator)")
    g.add_argument("--caption_drop_prob", type=CAPTION_DROP_PROB, default=0.0,
                   help="replace each caption by the empty one with this probability (classifier-free guidance)")
    g.add_argument("--ema_start", type=NUMBER_TEXT, default="0ba", help="with --use_ema: start averaging at this time (e.g. 1350000ba)")
    g.add_argument("--ema_half_life", type=NUMBER_TEXT, default="1000ba",
                   help="with --use_ema: EMA half-life in batches (6931ba is a smoothing of 0.9999 per batch)")
    g.add_argument("--ema_export_dir", type=str, default=None,
                   help="with --use_ema: write a complete diffusers pipeline with the EMA weights here at the end")
    g.add_argument("--snr_gamma", type=POSITIVE_FLOAT, default=None, help="min-SNR-gamma loss weighting (5 is the paper's value)")
    g.add_argument("--offset_noise", type=Range(float, 0, 1), default=0.0,
                   help="offset noise strength (e.g. 0.1; at most 1, where the offset is as strong as the noise)")
    g.add_argument("--loss_bins", type=Range(int, 0, MAX_LOSS_BINS), default=10,
                   help=f"log the loss in this many bins of timesteps (0: off; at most {MAX_LOSS_BINS}, and at most "
                        "the training timesteps of a DDPM model)")
    g.add_argument("--timestep_sampling", type=str, default="uniform", choices=TIMESTEP_SAMPLINGS,
                   help="how training draws timesteps: uniform (SD2's DDPM steps; Flux: t ~ U(0,1) as MLPerf's "
                        "reference), or logit_normal (SD3's, Flux only)")
    g = p.add_argument_group("validation loss (MLPerf's quality measure, every model)")
    g.add_argument("--eval_interval", type=NUMBER_TEXT, default=None,
                   help="compute the validation loss at 8 fixed timesteps on held-out samples this often (e.g. "
                        "1000ba) and at the end; off by default")
    g.add_argument("--eval_remote", type=str, default=None,
                   help="held-out MDS shards, in the training data's format (images, or latents with --precomputed)")
    g.add_argument("--eval_local", type=str, default=None, help="local cache of --eval_remote, or held-out shards on disk")
    g.add_argument("--eval_samples", type=POSITIVE_INT, default=None,
                   help="held-out samples per evaluation (default: 256 synthetic ones with --use_synth_data, "
                        "else all of --eval_remote)")
    g.add_argument("--eval_target", type=POSITIVE_FLOAT, default=None,
                   help="stop at the first evaluation at or under this validation loss, and report the samples and "
                        "time to it (MLPerf Flux.1: 0.586)")
    g.add_argument("--mlperf_log", type=str, default=None,
                   help="with --eval_interval: write the run's MLPerf-format log (:::MLLOG lines, for MLCommons' "
                        "compliance checker and scorer) to this file; default beside --results_json "
                        "(NAME.json: NAME.mlperf.log), none without it; off: no log (docs/mlperf.md)")
    g.add_argument("--mlperf_org", type=str, default="t2ibench", help="the MLPerf log's submission_org")
    g.add_argument("--mlperf_platform", type=str, default=None,
                   help="the MLPerf log's submission_platform (default: the world size and device, e.g. 8xNVIDIA H100 "
                        "80GB HBM3, or 1xcpu)")
    g = p.add_argument_group("FID and CLIP score at each evaluation (from files you have: nothing is downloaded)")
    g.add_argument("--fid_weights", type=str, default=None, metavar="PATH",
                   help="InceptionV3's FID weights (weights-inception-2015-12-05-6726825d.pth, the file torchmetrics' "
                        "FID downloads): FID of images drawn from the EMA weights against the held-out images; or a "
                        "TorchScript feature extractor (its FID is not comparable with published ones)")
    g.add_argument("--fid_real_stats", type=str, default=None, metavar="PATH",
                   help="the held-out images' FID statistics for --fid_weights: read from this file, or computed "
                        "before the run's clock starts and written here for later runs (default: computed each run, "
                        "before its clock starts)")
    g.add_argument("--clip_model", type=str, default=None, metavar="FOLDER",
                   help="a local transformers CLIP model folder, or a hub id in the local Hugging Face cache: CLIP "
                        "score of the drawn images and their captions (MLPerf's SD2: laion/CLIP-ViT-H-14-laion2B-s32B-b79K)")
    g.add_argument("--image_eval_samples", type=POSITIVE_INT, default=None,
                   help="held-out captions drawn and scored at each evaluation, the first ones in stored order "
                        "(default: all the evaluation reads; MLPerf's SD2: 30000); drawn with --sampler, "
                        "--sample_steps and --guidance_scale")
    g.add_argument("--fid_target", type=POSITIVE_FLOAT, default=None,
                   help="stop at the first evaluation at or under this FID, and every other target given (MLPerf's "
                        "SD2: 90)")
    g.add_argument("--clip_target", type=POSITIVE_FLOAT, default=None,
                   help="... at or over this CLIP score, torchmetrics' 100 x cosine (MLPerf's SD2: cosine 0.15, here 15)")
    g = p.add_argument_group("sample grids while training")
    g.add_argument("--sample_prompts", type=str, default=None,
                   help="draw these prompts while training: a text file (one per line) or a built-in set: default, shapes")
    g.add_argument("--sample_interval", type=NUMBER_TEXT, default="1000ba", help="sample every this long (and at the end)")
    g.add_argument("--samples_dir", type=str, default=None, help="where sample grids go (default: <--save_folder>/samples)")
    g.add_argument("--sample_size", type=str, default=None, metavar="HxW",
                   help="height x width of the samples in pixels, e.g. 768x1344: both multiples of the latent patch "
                        "(8 px; Flux.1 16), at most as many pixels as training's largest shape (default: square at "
                        "--image_size, with --aspect_buckets too)")
    g.add_argument("--sampler", type=str, default=None, choices=("ddim", "euler"),
                   help="diffusers sampler for samples: ddim (SD2's default) or euler (for Flux: flow-matching Euler, "
                        "FluxPipeline's)")
    g.add_argument("--sample_steps", type=SAMPLE_STEPS, default=50,
                   help=f"sampler steps per sample (at most {MAX_SAMPLE_STEPS}, the training timesteps of SD2 and SDXL)")
    g.add_argument("--guidance_scale", type=GUIDANCE_SCALE, default=7.5,
                   help="classifier-free guidance scale of samples (<= 1: none, as in diffusers)")
    return p
