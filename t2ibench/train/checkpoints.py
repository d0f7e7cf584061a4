"""Checkpoints in a local --save_folder written whole (Composer 0.32 writes straight to the final name)
and resumed from the newest complete one; the layout a checkpoint must have to load.
"""
from __future__ import annotations

import os
import re
import zipfile
from pathlib import Path

from t2ibench.train.data_order import RECORD_KEY
from t2ibench.core.files import no_room

# See `layout`; HalveMicrobatchOnOom (since issue 44) keeps no state: a resumed run searches its own first batches.
CALLBACKS_A_CHECKPOINT_MAY_LACK = ("KeepCpuThreadsOnResume", "HalveMicrobatchOnOom")
# Keys of a callback's state that a checkpoint may lack (see `layout`): RunRecord's bucket list, since
# issue 38 (export.py reads an older checkpoint's missing list as a square run's), and its data order,
# since issue 45 (a resume compares what an older checkpoint recorded, and says what it cannot compare).
CALLBACK_KEYS_A_CHECKPOINT_MAY_LACK = {"RunRecord": ("aspect_buckets", RECORD_KEY)}

LATEST = "latest-rank0.pt"  # Composer's symlink to the newest checkpoint of rank 0
SAVED = re.compile(r"ep(\d+)-ba(\d+)-rank0\.pt")  # Composer's default checkpoint names, rank 0


def write_whole() -> None:
    """Make Composer write every checkpoint under a temporary name and rename it when complete (once
    per process). A checkpoint that cannot be written raises an OSError naming it (a full disk:
    benchmark.py's one line), and leaves no part of itself."""
    import composer.utils.checkpoint as checkpoint

    original = checkpoint._write_checkpoint_file
    if getattr(original, "writes_whole", False):
        return

    def write(state_dict: dict, filename: str) -> None:
        folder, name = os.path.split(filename)
        # The same ending as the name: Composer picks tar or compression from it.
        partial = os.path.join(folder, f".partial-{os.getpid()}.{name}")
        try:
            original(state_dict, partial)
            os.replace(partial, filename)
        except BaseException as error:
            if os.path.exists(partial):
                os.unlink(partial)
            full = no_room(error)
            if full is not None:
                raise OSError(full.errno, full.strerror, filename) from error
            raise

    write.writes_whole = True
    checkpoint._write_checkpoint_file = write


def is_complete(path: Path) -> bool:
    """Whether a checkpoint file (a torch zip archive, Composer's `.pt`) is whole: a file cut short
    loses the archive's directory, which sits at its end."""
    try:
        with zipfile.ZipFile(path) as archive:
            return any(name.endswith("data.pkl") for name in archive.namelist())
    except (OSError, zipfile.BadZipFile, ValueError):
        return False


def gone_latest(save_folder: str | os.PathLike) -> str | None:
    """Where `latest-rank0.pt` points when that is gone (the checkpoint was moved or deleted: the link
    dangles), else None. Composer's autoresume tests the link with os.path.exists, which follows it,
    so a dangling one reads as no checkpoint yet: the run starts at batch 0 and replaces the link. Only
    a local folder has such links (an object store keeps `latest` as a `.symlink` object), and only
    rank 0's is read, on every rank."""
    latest = Path(save_folder, LATEST)
    if latest.is_symlink() and not latest.exists():
        return os.readlink(latest)
    return None


def resume_point(save_folder: str | os.PathLike) -> tuple[Path, Path] | None:
    """(the latest checkpoint, the newest complete one before it) when `latest-rank0.pt` points at an
    incomplete `.pt` checkpoint (the second is None when there is none); None when there is nothing to
    repair (no latest, a complete one, or a format this check does not read)."""
    latest = Path(save_folder, LATEST)
    if not latest.exists() or latest.suffix != ".pt" or is_complete(latest):
        return None
    target = latest.resolve()
    saved = sorted((p for p in Path(save_folder).iterdir() if SAVED.fullmatch(p.name) and p.resolve() != target),
                   key=lambda p: tuple(int(n) for n in SAVED.fullmatch(p.name).groups()), reverse=True)
    return target, next((p for p in saved if is_complete(p)), None)


def resume_from(latest: Path, previous: Path) -> Path:
    """Point `latest-rank0.pt` at `previous` (a complete checkpoint) and keep the incomplete `latest`
    as NAME.truncated (the user's bytes, never deleted); returns where the truncated file went."""
    kept = latest.with_name(latest.name + ".truncated")
    os.replace(latest, kept)
    link = Path(previous.parent, LATEST)
    temporary = link.with_name(f".{LATEST}.{os.getpid()}")
    os.symlink(previous.name, temporary)  # relative, as Composer makes it
    os.replace(temporary, link)
    return kept


def layout(path: str | os.PathLike) -> dict:
    """What a checkpoint must hold for this code to load it: every model tensor's name and shape,
    the parameters the optimizer keeps state for, the state keys of the algorithms that have state
    (the EMA's averaged tensors by name) and of the callbacks. Two releases whose layouts are equal read each other's
    checkpoints; `scripts/checkpoint_layout.py` writes one, tests/train/test_checkpoint_layout.py compares."""
    import torch

    state = torch.load(path, map_location="cpu", weights_only=False)["state"]

    def shapes(tensors: dict) -> dict[str, list[int]]:
        return {name: list(tensor.shape) for name, tensor in sorted(tensors.items())}

    algorithms = {}
    for name, algorithm_state in state["algorithms"]:
        if set(algorithm_state) <= {"repr"}:
            # Stateless (Composer's default state_dict holds the repr alone): nothing to restore.
            # Composer ignores such an entry it has no algorithm for, and warns, but loads, where a
            # checkpoint lacks one (grad_norm.GradientNorm, in every run since issue 36).
            continue
        algorithms[name] = {key: shapes(value) if key == "shadow" else type(value).__name__
                            for key, value in sorted(algorithm_state.items())}
    # Callbacks whose state a checkpoint may lack: Composer warns and loads, and the callback keeps this
    # run's own value (callbacks.resume_threads, since issue 36: the CPU thread count). Likewise the keys
    # a newer release added to a callback's state, which its readers take as absent in older ones.
    callbacks = {name: value for name, value in state["callbacks"].items()
                 if name not in CALLBACKS_A_CHECKPOINT_MAY_LACK}
    return {"model": shapes(state["model"]),
            "optimizers": {name: sorted(optimizer["state"]) for name, optimizer in sorted(state["optimizers"].items())},
            "algorithms": algorithms,
            "callbacks": {name: sorted(set(value) - set(CALLBACK_KEYS_A_CHECKPOINT_MAY_LACK.get(name, ())))
                          if isinstance(value, dict) else type(value).__name__
                          for name, value in sorted(callbacks.items())}}


def layout_digests(full: dict) -> dict[str, str]:
    """A layout in a few lines: {part: "N entries sha256:..."} per model part (unet, vae, ...),
    optimizer, algorithm and the callbacks; equal digests mean equal names and shapes."""
    import hashlib
    import json

    parts: dict[str, dict] = {}
    for name, shape in full["model"].items():
        parts.setdefault(f"model/{name.split('.')[0]}", {})[name] = shape
    parts.update({f"optimizer/{name}": keys for name, keys in full["optimizers"].items()})
    parts.update({f"algorithm/{name}": keys for name, keys in full["algorithms"].items()})
    parts["callbacks"] = full["callbacks"]
    return {part: f"{len(value)} entries sha256:" + hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()
            for part, value in sorted(parts.items())}
