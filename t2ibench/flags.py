"""Command-line flags shared by benchmark.py and latents.py, declared once: the data source, the
model, seeds and workers, and (benchmark.py) the Streaming settings. `check_shared` checks them the
same way in both. The parser itself is `cli.Parser`.
"""
from __future__ import annotations

import argparse
import math

from t2ibench.cli import FRACTION, IMAGE_SIZE, NON_NEGATIVE_INT, POSITIVE_INT, SECONDS, SEED
from t2ibench.cli import Parser, check_workers  # noqa: F401 - the commands' parser and its rules, with these groups
from t2ibench.errors import fail
from t2ibench.families import MODEL_CONFIGS, ModelFamily, family_of
from t2ibench.fp8 import FP8_MODES
from t2ibench.locations import DEFAULT_CACHE_ROOT
from t2ibench.sources import JoinSources
from t2ibench.streaming import MAX_BAD_FRACTION, SHUFFLE_ALGOS, StreamingSettings


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
    g.add_argument("--cache_limit", type=str, default=None,
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
    """--fp8: float8 training of the denoiser's Linear layers (t2ibench.fp8), for benchmark.py and the
    benchmarks that predict or run its step (bench/blocks.py, bench/bench_gpu.py)."""
    group.add_argument("--fp8", type=str, default="off", choices=FP8_MODES,
                       help="float8 training of the denoiser's Linear layers whose shapes float8 supports (torchao): "
                            "tensorwise or rowwise scales; the other layers keep the run's precision. Needs a GPU "
                            "of compute capability 8.9 or more; emulated on a CPU (numerics, not speed)")


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
    g.add_argument("--epoch_size", type=str, default=defaults.epoch_size,
                   help="samples per epoch drawn from all sources, e.g. 200000000 or 200m (default: all of them "
                        "once). The epoch's partition takes memory per sample: see docs/scale.md")
    g.add_argument("--num_canonical_nodes", type=POSITIVE_INT, default=defaults.num_canonical_nodes,
                   help="Streaming's canonical nodes, fixing the sample order across node counts (default: the nodes "
                        "of the first run); keep it when resuming on another number of nodes")
    g.add_argument("--sampling_granularity", type=POSITIVE_INT, default=defaults.sampling_granularity,
                   help="with --epoch_size below the dataset: samples taken from a shard at a time when an epoch "
                        "picks part of the data; the samples per shard picks whole shards (no shard downloaded "
                        "for a few samples)")


def check_shared(args: argparse.Namespace) -> ModelFamily:
    """The shared groups' values (one line naming the flag for a bad one); returns the model's family."""
    family = family_of(args.model_config)
    if args.model_name is None:
        args.model_name = family.default_model_name
    if args.image_size is None:
        args.image_size = family.default_image_size(args.model_config)
    multiple = family.latent_downsample * family.patch_size
    if args.image_size % multiple:
        fail(f"--image_size {args.image_size} must be a positive multiple of {multiple} (the VAE downsamples by "
             f"{family.latent_downsample}" + (f", and latents are cut into {family.patch_size}x{family.patch_size} "
                                              "patches)" if family.patch_size > 1 else ")"))
    if args.cache_limit is not None:
        from streaming.base.util import bytes_to_int
        try:
            limit = bytes_to_int(args.cache_limit)
        except (ValueError, TypeError):
            fail(f"--cache_limit {args.cache_limit} is not a size such as 500gb or 20mb")
        if not 0 < limit < math.inf:
            fail(f"--cache_limit {args.cache_limit} must be a positive size such as 500gb")
    return family
