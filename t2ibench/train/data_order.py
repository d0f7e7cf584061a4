"""What decides the samples each step of a run sees (the data, their order, the batch, the buckets):
recorded in every checkpoint (`callbacks.run_record.RunRecord`) and compared when a run resumes from
one. Mid-epoch, another value would repeat some samples of the epoch and skip others without a word, so
it is refused in one line; at an epoch's start the new value decides the next epoch whole and the run
goes on, saying so. The table of settings: docs/data.md#resuming-with-other-settings.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from t2ibench.core.locations import same_source_key

if TYPE_CHECKING:
    from t2ibench.train.settings import Settings

RECORD_KEY = "data_order"  # RunRecord's state key of the record (since issue 45: older checkpoints lack it)
RANKS = "ranks"  # the world size: no flag of its own (the launcher's), named so in the record and messages
NODES = "nodes"  # the nodes the ranks are on (the launcher's too)
# Refused at an epoch's start too: the resumed run keeps the checkpoint's value whatever the flag says
# (Composer 0.32 seeds from the checkpoint's rank_zero_seed; Streaming 0.13 restores its shuffle seed
# and canonical nodes from the loader's state), so the flag would be ignored, or half applied (the
# synthetic samples and draws follow --seed).
KEPT_FROM_THE_CHECKPOINT = {
    "--seed": "Composer and Streaming resume with the checkpoint's seed",
    "--num_canonical_nodes": "Streaming resumes with the checkpoint's canonical nodes",
}
LEGACY_KEYS = {"aspect_buckets": "--aspect_buckets", "image_size": "--image_size", "precomputed": "--precomputed"}
SHOWN_BUCKETS = 4  # a longer list is shown as its count and ends


def data_order(settings: Settings, world_size: int, nodes: int = 1) -> dict[str, Any]:
    """{flag: value} of every setting that decides which samples the run's steps see, in this kind of
    run (synthetic or real, square or bucketed, images or latents); a setting of no effect there is
    left out. Plain values (lists, numbers, strings), as a checkpoint keeps them."""
    order: dict[str, Any] = {"--use_synth_data": settings.use_synth_data, "--precomputed": settings.precomputed,
                             "--seed": settings.seed, "--batch_size": settings.batch_size,
                             "--aspect_buckets": [bucket.name for bucket in settings.buckets]}
    if settings.use_synth_data:
        order["--num_synthetic_samples"] = settings.num_synthetic_samples
        if settings.buckets:  # drawn per global step from the weights: no rank or worker counts
            order["--synthetic_bucket_weights"] = {bucket.name: weight for bucket, weight in
                                                   zip(settings.buckets, settings.bucket_weights)}
        return order
    order["--remote/--local"] = [source_key(source.remote or source.local, source.proportion)
                                 for source in settings.sources]
    from streaming.base.util import number_abbrev_to_int  # checks.check_numbers read it already

    order.update({"--no_shuffle": not settings.shuffle, "--shuffle_algo": settings.shuffle_algo,
                  "--shuffle_block_size": settings.shuffle_block_size,
                  "--epoch_size": None if settings.epoch_size is None else number_abbrev_to_int(settings.epoch_size),
                  "--sampling_granularity": settings.sampling_granularity,
                  "--num_canonical_nodes": settings.num_canonical_nodes})
    if settings.buckets:
        # One stream per bucket, batched per_stream (Streaming 0.13): a step's global batch is its stream's next
        # samples, but which rank takes which follows the node layout (a stream's samples are dealt over the
        # nodes, then their ranks: 2 nodes x 4 ranks and 1 x 8 deal them differently). The loader workers do
        # not matter: a resumed epoch is dealt anew over them from the next global batch.
        order.update({RANKS: world_size, NODES: nodes})
        if not settings.precomputed:  # an image's bucket and crop (stored latents have theirs)
            order.update({"--image_size": settings.image_size, "--bucket_crop": settings.bucket_crop})
    return order


def source_key(location: str, proportion: float | None) -> str:
    """One source as the record keeps it: compared after `same_source_key` (A and A/ are one)."""
    key = same_source_key(location)
    return key if proportion is None else f"{proportion:g}={key}"


# How much of the data order a checkpoint recorded (`saved_order`).
WHOLE, LEGACY, NONE = "whole", "legacy", "none"


def saved_order(record: dict[str, Any] | None) -> tuple[dict[str, Any], str]:
    """The data order a checkpoint's RunRecord state holds, and how much of it: WHOLE; LEGACY, for
    checkpoints saved before issue 45, which recorded only their bucket list, image size and --precomputed;
    NONE, for a checkpoint without RunRecord's state (written by another Composer script, or the state
    removed), where `record` is None."""
    if record is None:
        return {}, NONE
    if isinstance(record.get(RECORD_KEY), dict):
        return dict(record[RECORD_KEY]), WHOLE
    return {flag: record[key] for key, flag in LEGACY_KEYS.items() if key in record}, LEGACY


def shown(flag: str, value: Any) -> str:
    """A recorded value as a message shows it after its flag."""
    if flag == "--aspect_buckets":
        if not value:
            return "none (square)"
        return ",".join(value) if len(value) <= SHOWN_BUCKETS else f"{len(value)} buckets, {value[0]} ... {value[-1]}"
    if flag == "--synthetic_bucket_weights":  # {bucket: share}
        if len(set(value.values())) == 1:
            return "uniform"
        return ",".join(f"{name}={weight:.3g}" for name, weight in value.items() if weight > 0)
    if isinstance(value, list):
        return ",".join(map(str, value))
    return "unset" if value is None else str(value)


def difference(flag: str, saved: Any, given: Any) -> str:
    """'--batch_size 4 then, 8 now', with the buckets one list alone holds where the counts hide them."""
    line = f"{flag} {shown(flag, saved)} then, {shown(flag, given)} now"
    only = sorted(set(saved) ^ set(given)) if flag == "--aspect_buckets" else []
    if only and shown(flag, saved) == shown(flag, given):
        line += f" ({', '.join(only[:SHOWN_BUCKETS])} in one list only)"
    return line


def same(flag: str, saved: Any, given: Any) -> bool:
    """Whether a recorded value is the given one; shares of synthetic buckets within rounding (a release
    that normalises the weights in another order must not refuse the same --synthetic_bucket_weights)."""
    if flag == "--synthetic_bucket_weights" and isinstance(saved, dict) and isinstance(given, dict):
        return saved.keys() == given.keys() and all(math.isclose(saved[name], given[name], rel_tol=1e-9)
                                                    for name in given)
    return saved == given


def resume_problem(saved: dict[str, Any], recorded: str, given: dict[str, Any], epoch: int,
                   batch_in_epoch: int) -> tuple[str | None, list[str]]:
    """Compare a checkpoint's data order (`saved_order`) with this run's, where the resumed run stands
    (Composer's timestamp, loaded): the line that refuses a difference mid-epoch, or in a setting the
    checkpoint keeps (None: none), and the notes of a run that goes on."""
    differ = [(flag, saved[flag], value) for flag, value in given.items()
              if flag in saved and not same(flag, saved[flag], value)]
    mid_epoch = batch_in_epoch > 0
    refused = [d for d in differ if mid_epoch or d[0] in KEPT_FROM_THE_CHECKPOINT]
    if refused:
        why = [KEPT_FROM_THE_CHECKPOINT[flag] for flag, _, _ in refused if flag in KEPT_FROM_THE_CHECKPOINT]
        remedy = "resume with the checkpoint's values"
        if mid_epoch and len(why) < len(refused):
            why.append(f"the checkpoint stopped mid-epoch (epoch {epoch}, after its batch {batch_in_epoch}), so the "
                       "rest of the epoch would repeat some of its samples and skip others")
            remedy += ", from a checkpoint saved at an epoch's start (--save_interval in ep),"
        return (f"{'; '.join(difference(*d) for d in refused)}: {', and '.join(why)}; {remedy} or start a new run "
                "in another --save_folder"), []
    notes = []
    if differ:
        notes.append(f"resuming at the start of epoch {epoch} with {'; '.join(difference(*d) for d in differ)}: the "
                     "new values decide this epoch's samples from its first; no sample of an epoch is repeated or "
                     "skipped")
    # What the checkpoint did not record cannot be compared: mid-epoch any setting of the order, at an epoch's
    # start the ones a resumed run keeps from the checkpoint whatever the flags say.
    unchecked = [flag for flag in given if flag not in saved and (mid_epoch or flag in KEPT_FROM_THE_CHECKPOINT)]
    if recorded != WHOLE and unchecked:
        which = ("was saved before checkpoints recorded the data order" if recorded == LEGACY else
                 "records no run settings (RunRecord's state: written by another Composer script, or removed)")
        where = "mid-epoch" if mid_epoch else f"at the start of epoch {epoch}"
        must = ("they must be the values it was trained with, or the rest of the epoch repeats some samples "
                "and skips others" if mid_epoch else "the resumed run keeps the checkpoint's values whatever they say")
        notes.append(f"the checkpoint resumed {where} {which}: {', '.join(unchecked)} cannot be compared; {must}")
    return None, notes
