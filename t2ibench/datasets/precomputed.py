"""The on-disk format of precomputed latents (written by latents.py, read by data.py and checked
before training): one place for its text formats, column names, dtypes and record file.

The layout of a sample, the byte counts and the choice of dtypes are described in docs/data.md.
"""
from __future__ import annotations

import numpy as np

from t2ibench.families import MODEL_CONFIGS, ModelFamily
from t2ibench.families.family import TEXT_STATES_KEY, TOKENS_KEY
from t2ibench.core.images import GEOMETRY_KEYS
from t2ibench.core.tokenizer import MAX_LENGTH

TOKENS = "tokens"  # latents.py's default: the VAE posterior and the captions' token ids (text encoders run online)
TEXT_STATES = "text_states"  # latents.py --store_text_states: the text encoders' outputs are stored (none runs)
TEXT_FORMATS = (TOKENS, TEXT_STATES)
RECORD_FILE = "precompute.json"  # beside index.json: the settings the latents were computed with
LATENT_KEYS = ("latent_mean", "latent_logvar")  # the VAE posterior: in every precomputed sample
LATENT_DTYPES = ("float16", "float32")  # what a latent column may be stored as
TOKEN_DTYPES = ("uint8", "uint16", "int16", "int32", "int64")  # what a token-id column may be stored as
# --storage_dtype: the flag's name of each latent dtype (NumPy, hence MDS, has no bfloat16).
STORAGE_DTYPES = dict(zip(("fp16", "fp32"), LATENT_DTYPES))
# SD2's columns: TEXT_STATES_KEY in the text_states format; TOKEN_IDS_COLUMN in the tokens format, yielded as
# TOKENS_KEY, like image batches (the families' keys, families/family.py).
TOKEN_IDS_DTYPE = "uint16"  # CLIP's 49,408 and T5's 32,128 ids fit: half of int32, a quarter of int64
GEOMETRY_DTYPE = "int32"  # a micro-conditioned family's (SDXL) original size and crop, two each
# latents.py --aspect_buckets: each sample's bucket (height, width in pixels), int32, beside latents of
# that bucket's shape (their columns then have no fixed shape: MDS stores each sample's).
BUCKET_KEY = "bucket"
# The family of a format written without one named: SD2, the 2023 benchmark's model.
DEFAULT_FAMILY = MODEL_CONFIGS["sd2-base"]


def token_column(key: str, family: ModelFamily | None = None) -> str:
    """The column of a token-id batch key (SD2's `captions` are stored as `token_ids`; others as their key)."""
    return (family or DEFAULT_FAMILY).token_columns.get(key, key)


def stored_shapes(family: ModelFamily, config: str, text_states: bool) -> dict[str, tuple[int, ...]]:
    """{batch key: per-sample shape} of the text columns of a family's precomputed format."""
    return family.conditioning_shapes(config) if text_states else family.text_input_shapes(config)


def mds_columns(latent_channels: int, latent_size: int | None, text_dim: int | None = None, storage_dtype: str = "fp16",
                captions: bool = True, text_states: bool = False, *, family: ModelFamily | None = None,
                config: str | None = None, micro_conditioning: bool = False) -> dict[str, str]:
    """MDS columns of a precomputed dataset; the shapes are fixed, so no per-sample shape header.

    Without `family`, SD2's (77 token ids, or 77 x `text_dim` text states); with it, the family's
    batch keys at `config`'s shapes. `micro_conditioning` (SDXL) adds each image's original size and crop.
    `latent_size` None: latents stored per aspect-ratio bucket, each of its bucket's shape (the latent
    columns carry a shape per sample), and the bucket beside them (BUCKET_KEY).
    """
    dtype = STORAGE_DTYPES[storage_dtype]
    latent = (f"ndarray:{dtype}" if latent_size is None
              else f"ndarray:{dtype}:{latent_channels},{latent_size},{latent_size}")
    columns = {"index": "int64", "latent_mean": latent, "latent_logvar": latent}
    if family is None:
        shapes = {TEXT_STATES_KEY: (MAX_LENGTH, text_dim)} if text_states else {TOKENS_KEY: (MAX_LENGTH,)}
    else:
        shapes = stored_shapes(family, config or family.configs[0], text_states)
    for key, shape in shapes.items():
        encoding = dtype if text_states else TOKEN_IDS_DTYPE
        columns[key if text_states else token_column(key, family)] = f"ndarray:{encoding}:{','.join(map(str, shape))}"
    if micro_conditioning:
        columns.update({key: f"ndarray:{GEOMETRY_DTYPE}:2" for key in GEOMETRY_KEYS})
    if latent_size is None:
        columns[BUCKET_KEY] = f"ndarray:{GEOMETRY_DTYPE}:2"
    if captions:
        columns["caption"] = "str"
    return columns


def bytes_per_sample(image_size: int, text_dim: int = 1024, storage_dtype: str = "fp16", latent_channels: int = 4,
                     text_states: bool = False, conditioning_shapes: dict[str, tuple[int, ...]] | None = None,
                     micro_conditioning: bool = False) -> int:
    """Bytes of one sample's arrays and index before compression (captions and MDS offsets not counted)."""
    itemsize = np.dtype(STORAGE_DTYPES[storage_dtype]).itemsize
    latent = latent_channels * (image_size // 8) ** 2
    shapes = conditioning_shapes or {TEXT_STATES_KEY: (MAX_LENGTH, text_dim)}
    text = (sum(int(np.prod(shape)) for shape in shapes.values()) * itemsize if text_states
            else MAX_LENGTH * np.dtype(TOKEN_IDS_DTYPE).itemsize)
    geometry = len(GEOMETRY_KEYS) * 2 * np.dtype(GEOMETRY_DTYPE).itemsize if micro_conditioning else 0
    return 2 * latent * itemsize + text + geometry + 8


def text_format(columns: list[str], family: ModelFamily | None = None) -> str | None:
    """TOKENS or TEXT_STATES from a shard's column names (the family's, SD2's by default); None if
    they are not precomputed latents of that family."""
    family = family or DEFAULT_FAMILY
    if not all(k in columns for k in LATENT_KEYS):
        return None
    if all(k in columns for k in family.stored_text_columns(text_states=True)):
        return TEXT_STATES
    return TOKENS if all(k in columns for k in family.stored_text_columns(text_states=False)) else None


def column_arrays(names: list[str], encodings: list[str]) -> dict[str, tuple[str, tuple[int, ...] | None]]:
    """{column: (dtype, shape)} of the ndarray columns of an MDS shard, from its column names and
    encodings (`ndarray:float16:4,64,64`; the shape None when the column has none fixed, or one
    that is not numbers: a hand-edited index.json is reported, not a traceback)."""
    arrays = {}
    for name, encoding in zip(names, encodings):
        parts = str(encoding).split(":")
        if parts[0] == "ndarray" and len(parts) >= 2:
            try:
                shape = tuple(int(x) for x in parts[2].split(",")) if len(parts) == 3 else None
            except ValueError:
                shape = None
            arrays[name] = (parts[1], shape)
    return arrays


def default_format(family: ModelFamily) -> str:
    """The format a family's data is precomputed in unless the user chooses (Flux.1: TEXT_STATES)."""
    return TEXT_STATES if family.precomputes_text_states else TOKENS


def batch_text_format(family: ModelFamily, precomputed: bool, precomputed_format: str | None) -> str | None:
    """What a run's batches carry for the text: None online (captions' token ids, encoders in the
    step), else the precomputed format (the family's default when not given)."""
    if not precomputed:
        return None
    text_format = precomputed_format or default_format(family)
    if text_format not in TEXT_FORMATS:
        raise ValueError(f"precomputed_format must be one of {TEXT_FORMATS}, not {text_format!r}")
    return text_format
