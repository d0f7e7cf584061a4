"""The CLIP BPE tokenizer of Stable Diffusion 2, built offline from open-clip-torch's merges list when
`--model_name` has no `tokenizer/` folder.
"""
from __future__ import annotations

import gzip
import importlib.util
import json
import os
import tempfile
from pathlib import Path

from transformers import CLIPTokenizer

MAX_LENGTH = 77
VOCAB_SIZE = 49408
NUM_MERGES = VOCAB_SIZE - 2 * 256 - 2  # byte tokens, byte tokens ending a word, start and end tokens
CACHE_DIR = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "sd2-benchmark" / "clip-bpe"


def _byte_to_unicode() -> dict[int, str]:
    """Byte-level BPE works on printable characters: map each byte 0..255 to one unicode character.

    Printable latin-1 bytes map to themselves; the others are moved to code points 256 and up, in
    byte order. The vocabulary's first 256 entries are these characters in byte order.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping = {b: chr(b) for b in printable}
    shifted = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + shifted)
            shifted += 1
    return mapping


def _open_clip_merges_file() -> Path:
    # find_spec locates the package without importing it (importing open_clip pulls timm/torchvision).
    spec = importlib.util.find_spec("open_clip")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "The bundled CLIP tokenizer needs the BPE vocabulary shipped by the 'open-clip-torch' package: "
            "run `pip install -r requirements.txt` (or `pip install --no-deps open-clip-torch`)."
        )
    path = Path(next(iter(spec.submodule_search_locations))) / "bpe_simple_vocab_16e6.txt.gz"
    if not path.is_file():
        raise RuntimeError(f"{path} is missing: reinstall open-clip-torch to get the CLIP BPE vocabulary.")
    return path


def write_tokenizer_files(folder: Path) -> None:
    """Write `vocab.json` and `merges.txt` of the CLIP BPE tokenizer into `folder` (atomically)."""
    with gzip.open(_open_clip_merges_file(), "rt", encoding="utf-8") as f:
        merges = f.read().split("\n")[1 : NUM_MERGES + 1]  # first line is a version header
    byte_chars = list(_byte_to_unicode().values())
    tokens = byte_chars + [c + "</w>" for c in byte_chars] + ["".join(m.split()) for m in merges]
    tokens += ["<|startoftext|>", "<|endoftext|>"]
    assert len(tokens) == VOCAB_SIZE, len(tokens)
    folder.mkdir(parents=True, exist_ok=True)
    # Several ranks or loader workers may build the cache at once: write to temp files, then rename.
    # SD2's tokenizer settings: "!" pads (SD1 padded with the end token), 77 tokens.
    config = {"model_max_length": MAX_LENGTH, "pad_token": "!", "bos_token": "<|startoftext|>",
              "eos_token": "<|endoftext|>", "unk_token": "<|endoftext|>", "tokenizer_class": "CLIPTokenizer"}
    for name, text in (
        ("merges.txt", "#version: 0.2\n" + "\n".join(merges) + "\n"),
        ("vocab.json", json.dumps({t: i for i, t in enumerate(tokens)}, ensure_ascii=False)),
        ("tokenizer_config.json", json.dumps(config, indent=2)),
    ):
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{name}.")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, folder / name)


def bundled_tokenizer(pad_token: str = "!") -> CLIPTokenizer:
    """SD2's tokenizer (pad token "!", 77 tokens) built from the locally installed BPE vocabulary.

    `pad_token="<|endoftext|>"` gives OpenAI's CLIP-L tokenizer, as SD1 and Flux use it (same vocabulary).
    """
    if not all((CACHE_DIR / name).is_file() for name in ("vocab.json", "merges.txt", "tokenizer_config.json")):
        try:
            write_tokenizer_files(CACHE_DIR)
        except OSError:
            # No writable cache (a read-only or missing HOME on a cluster node): build the files in a
            # temporary folder for this process; the tokenizer keeps what it read in memory.
            with tempfile.TemporaryDirectory(prefix="clip-bpe-") as folder:
                write_tokenizer_files(Path(folder))
                return CLIPTokenizer.from_pretrained(folder, pad_token=pad_token)
    # from_pretrained on a folder reads the files the same way in transformers 4 and 5
    # (their constructors differ: file paths in 4, vocab dict and merges list in 5).
    return CLIPTokenizer.from_pretrained(str(CACHE_DIR), pad_token=pad_token)


def tokenize(tokenizer: CLIPTokenizer, captions: list[str]) -> "torch.Tensor":  # noqa: F821
    """Token ids, shape (len(captions), 77): start token, caption, end token, padding; truncated."""
    return tokenizer(
        captions, padding="max_length", max_length=MAX_LENGTH, truncation=True, return_tensors="pt"
    ).input_ids
