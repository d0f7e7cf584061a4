"""The on-disk format of precomputed latents (written by latents.py, read by data.py and checked
before training): one place for its text formats, column names, dtypes and record file.

The layout of a sample, the byte counts and the choice of dtypes are described in docs/data.md.
"""
from __future__ import annotations

TOKENS = "tokens"  # latents.py's default: the VAE posterior and the captions' token ids (text encoders run online)
TEXT_STATES = "text_states"  # latents.py --store_text_states: the text encoders' outputs are stored (none runs)
TEXT_FORMATS = (TOKENS, TEXT_STATES)
RECORD_FILE = "precompute.json"  # beside index.json: the settings the latents were computed with
LATENT_KEYS = ("latent_mean", "latent_logvar")  # the VAE posterior: in every precomputed sample
LATENT_DTYPES = ("float16", "float32")  # what a latent column may be stored as
TOKEN_DTYPES = ("uint8", "uint16", "int16", "int32", "int64")  # what a token-id column may be stored as
