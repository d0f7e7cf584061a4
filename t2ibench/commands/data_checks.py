"""Checks of the data benchmark.py's flags name, before anything is built: each source's MDS index and
shard files, the columns and kind of its shards, precomputed latents against the run (precompute.json),
and enough samples for one global batch. `t2ibench.commands.checks.validate` runs them.
"""
from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path

from composer.core import Time

from t2ibench.datasets.bucket_folders import LATENTS, read_record, unsorted_problem
from t2ibench.datasets.bucket_folders import RECORD_FILE as BUCKETS_RECORD
from t2ibench.core.errors import fail, storage_error
from t2ibench.families import FAMILIES, ModelFamily
from t2ibench.eval.image_metrics import check_image_flags
from t2ibench.core.images import GEOMETRY_KEYS
from t2ibench.core.locations import is_remote, same_source_key
from t2ibench.core.mds import holds_samples_it_does_not_list, index_problem, shard_file
from t2ibench.datasets.precomputed import BUCKET_KEY, LATENT_DTYPES, LATENT_KEYS, RECORD_FILE, TOKEN_DTYPES, column_arrays
from t2ibench.train.settings import Settings
from t2ibench.datasets.sources import Source, check_cache
from t2ibench.eval.validation import held_out_read

SYNTHETIC_EVAL_SAMPLES = 256  # held-out synthetic samples without --eval_samples (benchmark.build_data's too)


def read_index(index_file: Path, label: str) -> dict:
    """An MDS index.json, or a one-line error naming `label` (the flag and location)."""
    try:
        index = json.loads(index_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        fail(f"{label}: {index_file} is not a readable MDS index ({error}); re-create the dataset with convert.py")
    problem = index_problem(index)  # fields of the wrong type: refused here, not deep in Streaming
    if problem:
        fail(f"{label}: {index_file} is not a usable MDS index: {problem}; re-create the dataset with convert.py")
    return index


def check_index(index: dict, label: str, settings: Settings) -> int:
    """Columns of an MDS dataset against the flags (the right kind of shards); returns its number of samples."""
    shards = index["shards"]
    num_samples = sum(shard["samples"] for shard in shards)  # read_index checked that they are counts
    columns = list(shards[0].get("column_names", [])) if shards else []
    if num_samples == 0:
        fail(f"{label} holds no samples; convert some data into it with convert.py")
    # A shard listed with 0 samples whose file holds some: Streaming would train around those samples
    # without a word. One that holds none (Streaming's MDSWriter wrote one before a first sample larger
    # than size_limit) loses nothing and is read as nothing.
    uncounted = [shard_file(shard) for shard in shards if holds_samples_it_does_not_list(shard)]
    if uncounted:
        fail(f"{label}: shard {uncounted[0]} holds no samples (index.json lists 0) but its file is larger than an "
             "empty shard: the dataset is damaged; re-convert it")
    latents = LATENT_KEYS[0] in columns  # the posterior's mean: in every precomputed sample
    if settings.precomputed and not latents:
        fail(f"--precomputed: {label} holds image shards (columns {columns}), not precomputed latents; "
             "drop --precomputed, or write latents from them with latents.py")
    if not settings.precomputed and latents:
        fail(f"{label} holds precomputed latents (columns {columns}); add --precomputed to train from them")
    if settings.precomputed:
        family = settings.family
        if not any(set(family.stored_text_columns(states)) <= set(columns) for states in (True, False)):
            others = [other.name for other in FAMILIES if other is not family and any(
                set(other.stored_text_columns(states)) <= set(columns) for states in (True, False))]
            fail(f"--precomputed: {label} holds " + (f"latents precomputed for {others[0]}" if others else
                 f"no text columns of {family.name}") + f" (columns {columns}), not for --model_config "
                 f"{settings.model_config}; precompute them with latents.py --model_config {settings.model_config}")
        missing = [key for key in GEOMETRY_KEYS if family.micro_conditioning and key not in columns]
        if missing:
            fail(f"--precomputed: {label} holds latents without {', '.join(missing)}, which --model_config "
                 f"{settings.model_config} is conditioned on (precomputed for another model?); write them with "
                 f"latents.py --model_config {settings.model_config}")
        for shard in shards:  # every shard: the parts of a merged index may differ
            problem = precomputed_shard_problem(shard, family, settings.model_config, settings.image_size,
                                                bool(settings.buckets))
            if problem:
                fail(f"--precomputed: {label}: shard {shard_file(shard)} {problem}")
    hashes = shards[0].get("hashes", []) if shards else []
    if settings.validate_hash and settings.validate_hash not in hashes:
        fail(f"--validate_hash {settings.validate_hash}: the shards of {label} list no such hash (they have {hashes}); "
             + ("use one of them" if hashes else "leave the flag out"))
    if not settings.precomputed:
        for flag in ("image_key", "caption_key"):
            if getattr(settings, flag) not in columns:
                fail(f"--{flag} {getattr(settings, flag)} is not a column of {label}; its columns are {columns}")
    return num_samples


def check_shard_files(folder: Path, index: dict, label: str, settings: Settings, every_shard: bool) -> None:
    """The shard files on this machine against index.json, before training: each present file has the
    size listed (a truncated copy is named here, not found by a loader thread mid-epoch), and with
    --validate_hash its hash. Streaming validates only what it downloads; files already here (local
    data, or a filled cache) it uses as they are, so they are read and hashed here, once. With
    `every_shard` (the data itself, not a cache) each shard must have its file."""
    from streaming.base.hashing import get_hash
    for shard in index["shards"]:
        infos = [info for info in (shard.get("raw_data"), shard.get("zip_data")) if isinstance(info, dict)]
        present = [(info, Path(folder, info["basename"])) for info in infos if Path(folder, info["basename"]).is_file()]
        if every_shard and infos and not present:
            fail(f"{label}: shard {infos[-1]['basename']} listed in index.json is missing; re-convert the dataset "
                 "(or copy it again)")
        for info, path in present:
            size = path.stat().st_size
            if isinstance(info.get("bytes"), int) and size != info["bytes"]:
                fail(f"{label}: shard {path} holds {size:,} bytes where index.json lists {info['bytes']:,}: it is "
                     "truncated or altered; re-convert the dataset, or delete the file to download it again")
            expected = (info.get("hashes") or {}).get(settings.validate_hash) if settings.validate_hash else None
            if expected and get_hash(settings.validate_hash, path.read_bytes()) != expected:
                fail(f"--validate_hash {settings.validate_hash}: shard {path} does not match its hash in index.json: it is "
                     "corrupted; re-convert the dataset, or delete the file to download it again")


def precomputed_shard_problem(shard: dict, family: ModelFamily, config: str, image_size: int,
                              bucketed: bool = False) -> str | None:
    """What makes one shard of precomputed latents unfit for this run (from its column encodings in
    index.json: no data read), or None: latents of another size or channel count, arrays without a
    fixed shape, float token ids, text columns of other shapes; latents stored per aspect-ratio bucket
    for a square run (`bucketed` False) or square ones for a bucketed run."""
    encodings = dict(zip(shard.get("column_names", []), shard.get("column_encodings", [])))
    arrays = column_arrays(list(encodings), list(encodings.values()))
    array = arrays.get  # (dtype, shape) of an ndarray column, None for any other or a missing one
    fixed = "latents.py stores every array with a fixed shape (ndarray:float16:4,64,64): write them with latents.py"

    if BUCKET_KEY in encodings and not bucketed:
        return ("holds latents stored per aspect-ratio bucket (latents.py --aspect_buckets): train with "
                "--aspect_buckets and the same list")
    channels, side = family.latent_channels(config), image_size // family.latent_downsample
    for key in LATENT_KEYS if not bucketed else ():  # bucketed: each sample has its bucket's shape
        found = array(key)
        if found is None or found[1] is None:
            return f"stores {key} as {encodings.get(key)!r}, without a fixed shape; {fixed}"
        dtype, shape = found
        if dtype not in LATENT_DTYPES or len(shape) != 3:
            return f"stores {key} as {encodings[key]!r}: latents are {' or '.join(LATENT_DTYPES)} arrays (C, H, W)"
        if shape[0] != channels:
            return (f"holds {shape[0]}-channel latents; the VAE of --model_config {config} makes {channels}: "
                    f"precompute them with latents.py --model_config {config}")
        if shape[1:] != (side, side):
            made = "x".join(str(n * family.latent_downsample) for n in shape[1:])
            return (f"holds latents of {made} images, not --image_size {image_size}: train at --image_size "
                    f"{shape[1] * family.latent_downsample}, or precompute at --image_size {image_size} with latents.py")
    states = all(key in encodings for key in family.stored_text_columns(True))
    expected = family.conditioning_shapes(config) if states else family.text_input_shapes(config)
    for key, shape in expected.items():
        column = key if states else family.token_columns.get(key, key)
        found = array(column)
        if found is None or found[1] is None:
            return f"stores {column} as {encodings.get(column)!r}, without a fixed shape; {fixed}"
        if tuple(found[1]) != tuple(shape):
            return (f"holds {column} of shape {found[1]}, but --model_config {config} takes {tuple(shape)}: computed for "
                    "another model or text encoder; precompute them with latents.py --model_config " + config)
        if not states and found[0] not in TOKEN_DTYPES:
            return f"stores the token ids {column} as {found[0]}, not integers; write them with latents.py"
    return None


def check_dataset_size(num_samples: int, label: str, settings: Settings) -> None:
    """Every rank drops its last partial batch: fewer samples than one global batch means no step at
    all (Composer then loops over empty epochs forever, or 'finishes' 1ep after 0 batches)."""
    if num_samples < settings.batch_size:
        fail(f"{label} holds {num_samples} samples, fewer than one global batch (--batch_size {settings.batch_size}): "
             f"no step could run; pass a --batch_size of at most {num_samples}, or use more data")


def check_data(settings: Settings) -> tuple[int, int | None]:
    """The dataset the flags name: it exists, is MDS, has the columns asked for and >= one global batch.
    Returns the samples of one epoch, and the seed of the random encoders that made its latents (None:
    no such record; check_precompute_record)."""
    if settings.use_synth_data and settings.sources:
        fail("--use_synth_data trains on random samples and would ignore " + ("--remote" if settings.remote else "--local")
             + "; pass one or the other")
    if settings.use_synth_data:
        check_dataset_size(settings.num_synthetic_samples,
                           f"the synthetic dataset (--num_synthetic_samples {settings.num_synthetic_samples})", settings)
        return settings.num_synthetic_samples, None
    if not settings.sources:
        fail("no data: pass --use_synth_data, or --remote (with --local as cache), or --local with MDS shards "
             "already there")
    if not settings.remote and not Path(settings.sources[0].local).is_dir():
        fail(f"--local {settings.local} is not a folder; give --remote to stream shards into it")
    for source in settings.sources:
        if source.remote and not is_remote(source.remote) and not Path(source.remote, "index.json").is_file() \
                and not Path(source.remote, BUCKETS_RECORD).is_file():
            fail(f"--remote {source.remote} holds no MDS dataset (no index.json); write one with convert.py first")
    num_samples, recorded_seed = check_sources(settings.sources, settings, None)
    if settings.epoch_size is None:
        # With --epoch_size, Streaming draws that many samples whatever the sources hold.
        check_dataset_size(num_samples, " + ".join(source.label for source in settings.sources), settings)
        return num_samples, recorded_seed
    from streaming.base.util import number_abbrev_to_int
    return number_abbrev_to_int(settings.epoch_size), recorded_seed


def check_sources(sources: tuple[Source, ...], settings: Settings, recorded_seed: int | None,
                  held_out: bool = False) -> tuple[int, int | None]:
    """check_source for each source in turn: their samples in all, and the one seed their records give.
    Held-out data is read square, bucketed run or not."""
    num_samples = 0
    for source in sources:
        samples, recorded_seed = check_source(source, settings, recorded_seed, held_out)
        num_samples += samples
    return num_samples, recorded_seed


def check_source(source: Source, settings: Settings, recorded_seed: int | None,
                 held_out: bool = False) -> tuple[int, int | None]:
    """One source's cache, record and index (see check_data); returns its number of samples, and the
    encoders' seed recorded so far (`recorded_seed`, or this source's)."""
    local, remote = source.local, source.remote
    if Path(local).exists() and not Path(local).is_dir():
        fail(f"--local {local} is a file, not a folder")
    check_cache(source, timeout=settings.download_timeout)
    if settings.buckets and not held_out:
        return check_sorted_source(source, settings, recorded_seed)
    if Path(remote or local, BUCKETS_RECORD).is_file():
        fail(f"{source.label} is sorted into aspect-ratio bucket folders ({BUCKETS_RECORD}): train on it with "
             "--aspect_buckets")
    if settings.precomputed and (not remote or not is_remote(remote)):
        recorded_seed = check_precompute_record(Path(remote or local, RECORD_FILE), settings, recorded_seed)
    if remote and not is_remote(remote) and Path(remote, "index.json").is_file():
        check_shard_files(Path(remote), read_index(Path(remote, "index.json"), remote), f"--remote {remote}", settings,
                          every_shard=True)
    if Path(local, "index.json").is_file():  # Streaming reads the cached index rather than the remote's
        index = read_index(Path(local, "index.json"), local)
        samples = check_index(index, f"--local {local}", settings)
        check_shard_files(Path(local), index, f"--local {local}", settings, every_shard=not remote)
        return samples, recorded_seed
    if not remote:
        fail(f"--local {local} holds no MDS dataset (no index.json): write one with convert.py, "
             "or pass --remote to stream one into it")
    if not is_remote(remote):
        return check_index(read_index(Path(remote, "index.json"), remote), f"--remote {remote}", settings), recorded_seed
    # The index is small: fetch it with Streaming's own downloader to check it before anything
    # is built; credentials, endpoint and path errors surface here, as one line.
    from streaming.base.storage import CloudDownloader
    with tempfile.TemporaryDirectory() as folder:
        try:
            CloudDownloader.direct_download(f"{remote.rstrip('/')}/index.json", f"{folder}/index.json",
                                            settings.download_timeout)
        except Exception as error:  # noqa: BLE001  any store's client error: reported, not hidden
            if settings.debug:
                raise
            fail(f"--remote {remote}: cannot read index.json: {storage_error(error) or error}")
        if settings.precomputed:
            try:  # written by latents.py next to its index.json; latents from elsewhere have none
                CloudDownloader.direct_download(f"{remote.rstrip('/')}/{RECORD_FILE}", f"{folder}/{RECORD_FILE}",
                                                settings.download_timeout)
            except Exception:  # noqa: BLE001  absent: nothing recorded to compare
                pass
            recorded_seed = check_precompute_record(Path(folder, RECORD_FILE), settings, recorded_seed,
                                                    f"{remote.rstrip('/')}/{RECORD_FILE}")
        return check_index(read_index(Path(folder, "index.json"), remote), f"--remote {remote}", settings), recorded_seed


def check_sorted_source(source: Source, settings: Settings, recorded_seed: int | None) -> tuple[int, int | None]:
    """A source of a bucketed run: sorted into bucket folders (their record), of the run's kind; a local one's
    folders are checked as check_source checks a dataset. An unsorted one, or latents of before, are refused
    in one line naming sort_buckets.py. Returns its samples and the encoders' seed recorded so far."""
    where = source.remote or source.local
    flag = "--remote" if source.remote else "--local"
    local_data = not source.remote or not is_remote(source.remote)
    with tempfile.TemporaryDirectory() as folder:
        found = Path(where) if local_data else Path(folder)
        if not local_data:
            from streaming.base.storage import CloudDownloader
            for name in (BUCKETS_RECORD, "index.json", RECORD_FILE):
                try:  # small files: the record, else the index that says what the dataset is
                    CloudDownloader.direct_download(f"{where.rstrip('/')}/{name}", f"{folder}/{name}",
                                                    settings.download_timeout)
                except FileNotFoundError:
                    continue
                except Exception as error:  # noqa: BLE001  any store's client error: reported, not hidden
                    if settings.debug:
                        raise
                    fail(f"{flag} {where}: cannot read {name}: {storage_error(error) or error}")
                if name == BUCKETS_RECORD:
                    break
        try:
            record = read_record(found)
        except ValueError as error:
            fail(f"{flag} {where}: {error}; sort the dataset again with sort_buckets.py")
        if record is None:
            if not (found / "index.json").is_file():
                fail(f"{flag} {where} holds no dataset sorted into bucket folders (no {BUCKETS_RECORD}): write one with "
                     "convert.py --aspect_buckets")
            index = read_index(found / "index.json", where)
            columns = list(index["shards"][0].get("column_names", [])) if index["shards"] else []
            fail(unsorted_problem(flag, where, columns))
        if settings.precomputed != (record.kind == LATENTS):
            fail(f"{flag} {where} holds {record.kind} sorted into bucket folders: "
                 + ("add --precomputed" if record.kind == LATENTS else "drop --precomputed"))
        if settings.precomputed:
            recorded_seed = check_precompute_record(found / RECORD_FILE, settings, recorded_seed,
                                                    f"{where.rstrip('/')}/{RECORD_FILE}")
    if local_data:
        for entry in record.folders:
            folder_path = Path(where, entry.folder)
            index = read_index(folder_path / "index.json", f"{flag} {where}")
            check_index(index, f"{flag} {folder_path}", settings)
            check_shard_files(folder_path, index, f"{flag} {folder_path}", settings, every_shard=True)
    return record.num_samples, recorded_seed


def check_evaluation(settings: Settings, recorded_seed: int | None) -> int | None:
    """The validation-loss flags, and the held-out data they name (as check_data checks the training data);
    returns the encoders' seed recorded by the training data (`recorded_seed`) or by the held-out data."""
    given = [flag for flag in ("eval_remote", "eval_local", "eval_samples", "eval_target")
             if getattr(settings, flag) is not None]
    if not settings.eval_interval:
        if given:
            fail(f"--{given[0]} needs --eval_interval (how often to compute the validation loss, e.g. 1000ba)")
        check_image_flags(settings, None)
        return recorded_seed
    try:
        unit = Time.from_timestring(settings.eval_interval).unit.value
    except (ValueError, TypeError):
        unit = None
    if unit not in ("ba", "ep") or not Time.from_timestring(settings.eval_interval).value > 0:
        fail(f"--eval_interval '{settings.eval_interval}' must be a positive Composer time string in ba or ep "
             "(e.g. 1000ba)")
    if settings.eval_samples is not None and settings.eval_samples <= 0:
        fail(f"--eval_samples {settings.eval_samples} must be positive")
    if settings.eval_target is not None and not (math.isfinite(settings.eval_target) and settings.eval_target > 0):
        fail(f"--eval_target {settings.eval_target} must be a positive loss, e.g. 0.586")
    if settings.use_synth_data:
        if settings.eval_sources:
            fail("--use_synth_data evaluates on synthetic held-out samples and would ignore --eval_remote/--eval_local; "
                 "pass one or the other")
        # No global batch needed: every held-out sample is scored once, however few (validation.held_out_loader).
        check_image_flags(settings, None)
        return recorded_seed
    if not settings.eval_sources:
        fail("--eval_interval needs held-out data: --eval_remote (with --eval_local as cache) or --eval_local with MDS "
             "shards in the training data's format")
    for source in settings.eval_sources:
        if source.remote and not is_remote(source.remote) and not Path(source.remote, "index.json").is_file():
            fail(f"--eval_remote {source.remote} holds no MDS dataset (no index.json)")
        if not source.remote and not Path(source.local, "index.json").is_file():
            fail(f"--eval_local {source.local} holds no MDS dataset (no index.json); pass --eval_remote to stream one")
    num_samples, recorded_seed = check_sources(settings.eval_sources, settings, recorded_seed, held_out=True)
    read = held_out_read(num_samples, settings.eval_samples)
    if read < 1:  # any other count is scored whole, each sample once (validation.held_out_loader)
        fail("--eval_remote/--eval_local holds no held-out sample; give shards of at least one")
    check_image_flags(settings, read)
    return recorded_seed


def describe_buckets(names: list[str] | None) -> str:
    """A bucket list in a few words for a one-line message: none, or its count and ends."""
    if not names:
        return "none (square latents)"
    return f"{len(names)} buckets, {names[0]} ... {names[-1]}" if len(names) > 2 else ", ".join(names)


def check_precompute_record(record: Path, settings: Settings, recorded_seed: int | None,
                            name: str | None = None) -> int | None:
    """Compare what latents.py recorded in precompute.json with this run. A different --model_config or
    --image_size, or other pretrained encoders (--model_name), is refused: the latents were made by other
    encoders than the run uses. Random encoders (the tiny model, --allow_random_encoders) are rebuilt
    from the recorded seed, whatever --seed is (it still seeds the denoiser, noise and data order): returns
    the seed the run follows, `recorded_seed` (another source's) or this record's, which must agree."""
    name = name or str(record)
    if not record.is_file():
        return recorded_seed
    try:
        recorded = json.loads(record.read_text())
        if not isinstance(recorded, dict):
            raise ValueError("not a JSON object")
    except (OSError, UnicodeDecodeError, ValueError) as error:
        fail(f"--precomputed: {name} is not readable ({error}); it records how the latents were computed: "
             "restore it, or compute the latents again with latents.py")
    for key, flag in (("model_config", "model_config"), ("image_size", "image_size")):
        if recorded.get(key) is not None and recorded[key] != getattr(settings, flag):
            fail(f"--{flag} {getattr(settings, flag)}: the latents were computed with --{flag} {recorded[key]} "
                 f"({name}); pass --{flag} {recorded[key]}, or compute latents for this setting with latents.py")
    made_buckets, run_buckets = recorded.get("aspect_buckets"), [b.name for b in settings.buckets] or None
    if settings.buckets and made_buckets != run_buckets:
        fail(f"--aspect_buckets {settings.aspect_buckets}: the latents were stored in other buckets ({name}: "
             f"{describe_buckets(made_buckets)}; this run: {describe_buckets(run_buckets)}); pass the list they were "
             "computed with, or compute latents for this list with latents.py --aspect_buckets")
    made_with = recorded.get("model_name")
    if made_with and same_source_key(made_with) != same_source_key(settings.model_name) \
            and not Path(settings.model_name).is_dir():
        fail(f"--model_name {settings.model_name}: the latents were computed with --model_name {made_with} ({name}); "
             f"pass --model_name {made_with} (or a local folder holding that model)")
    seed = recorded.get("seed") if recorded.get("random_encoders") else None
    if seed is None:
        return recorded_seed
    if recorded_seed is not None and recorded_seed != seed:
        fail(f"--remote: the sources were precomputed with random encoders of different seeds ({recorded_seed} and "
             f"{seed}, {name}): no one set of encoders fits both; precompute them with the same --seed")
    return seed
