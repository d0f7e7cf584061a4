"""Exponential moving average (EMA) of the trainable weights, as a Composer algorithm.

What it keeps: one fp32 "shadow" tensor per trainable parameter (``requires_grad=True``), on the
parameter's device, keyed by the parameter's name in ``state.model`` with wrapper prefixes removed
(``module.`` of DDP, ``_fsdp_wrapped_module.``, ``_checkpoint_wrapped_module.``, ``_orig_mod.``), so
for ``t2ibench.train.model.DiffusionModel`` the denoiser's entries are ``unet.*`` (``transformer.*`` for
Flux.1). Frozen parameters (the VAE and the text encoders) and buffers are not copied: they do not
change, so averaging them is pure cost. Extra memory is therefore exactly 4 bytes per trainable
parameter (3.46 GB for the SD2 UNet).

How it updates: once per update, after the optimizer step (``Event.BATCH_END``, or
``Event.EPOCH_END`` for epoch intervals), with one multi-tensor call over all tensors::

    shadow = smoothing * shadow + (1 - smoothing) * param      # torch._foreach_lerp_

Under FSDP each rank averages only the local shards it holds (FSDP1 flat-parameter views with
``use_orig_params=True``, or the local part of FSDP2 DTensors): nothing is gathered, and the shadow
takes 4 bytes per parameter divided by the number of ranks. Under DDP every rank holds identical
parameters, so every rank computes the identical shadow without communicating.

Schedule (same as ``composer.algorithms.EMA``): the shadow is initialized as a copy of the
parameters at the first update event at or after ``ema_start`` (so with the default ``"0ba"`` it
starts from the weights after the first optimizer step); after that it is updated at every event
whose count (batches or epochs completed) is a multiple of ``update_interval``.

Checkpoints: ``state_dict()`` carries the shadow and the counters, so Composer's ``save_folder`` /
``load_path`` / ``autoresume`` bring it back bit for bit. The model weights in a checkpoint stay the
training weights (Composer's EMA instead swaps the averaged weights into the model while saving).
Under FSDP the shards are gathered to rank 0 at save time only (see :meth:`EMA.state_dict`). With
FSDP2 (DTensor parameters) the checkpoint holds whole tensors, as an unsharded run's does, and each
rank cuts its own part again when it loads, so a run may resume on another number of ranks or
without FSDP; with FSDP1 it holds each rank's flat shards and must resume with the same world size
and wrapping.

Using the average: ``with ema.averaged_weights(model): ...`` swaps it into the model and back, and
``ema.export_denoiser(model, path)`` (or ``EMA(..., export_dir=path)``, run at ``Event.FIT_END``) writes
the averaged denoiser as a diffusers folder that its class's ``from_pretrained`` reads
(``UNet2DConditionModel``, ``FluxTransformer2DModel``).
"""
from __future__ import annotations

import contextlib
import os
import warnings
import weakref
from typing import Any, Iterator, Optional

import torch
from composer.core import Algorithm, Event, State, Time, TimeUnit
from composer.loggers import Logger
from composer.utils import dist

try:  # DTensor (FSDP2 parameters) is public from torch 2.5; older builds simply have no DTensors.
    from torch.distributed.tensor import DTensor as _DTensor
    from torch.distributed.tensor import distribute_tensor
except ImportError:  # pragma: no cover - depends on the torch build
    _DTensor = None

try:
    from torch.distributed.fsdp import FullyShardedDataParallel as _FSDP
except ImportError:  # pragma: no cover - torch built without distributed support
    _FSDP = None

__all__ = ["EMA"]

# Name segments that wrappers insert into parameter names; dropping them keeps shadow keys portable
# between single-process, DDP, FSDP, activation-checkpointed and torch.compile'd runs.
_WRAPPER_SEGMENTS = frozenset({"_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod"})

# When parameters are not fp32 they are cast to fp32 before the lerp; the casts are done this many
# elements at a time so that the temporary costs at most 4 * 2**25 bytes = 128 MiB, not a full copy.
_CAST_CHUNK_NUMEL = 1 << 25

_FORMAT = "ema-shadow-v1"  # marks our state dict, so a checkpoint of Composer's own EMA is rejected clearly


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The module under DDP wrappers (Composer wraps ``state.model`` in DDP for multi-process runs)."""
    ddp = torch.nn.parallel.DistributedDataParallel
    while isinstance(model, ddp):
        model = model.module
    return model


def _clean_name(name: str) -> str:
    return ".".join(part for part in name.split(".") if part not in _WRAPPER_SEGMENTS)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The part of ``tensor`` this rank holds: the local shard of a DTensor, else the tensor itself.

    Both share storage with the parameter, so in-place writes (the weight swap) reach the model.
    """
    if _DTensor is not None and isinstance(tensor, _DTensor):
        return tensor.to_local()
    return tensor


def _is_sharded(model: torch.nn.Module, params: list[torch.Tensor]) -> bool:
    """Whether parameters are FSDP shards, i.e. differ between ranks."""
    if _DTensor is not None and any(isinstance(p, _DTensor) for p in params):
        return True
    return _FSDP is not None and any(isinstance(m, _FSDP) for m in _unwrap(model).modules())


def _parse_time(option: str, value: Any, units: tuple[TimeUnit, ...]) -> Time:
    """``Time`` from a time string, or a one-line ValueError naming ``option``."""
    if not isinstance(value, str):
        raise ValueError(f"EMA {option}: expected a time string such as '10ba', got {value!r}")
    try:
        time = Time.from_timestring(value)
    except (ValueError, TypeError) as e:
        raise ValueError(f"EMA {option}: cannot parse {value!r} as a time string ({e})") from None
    if time.unit not in units:
        allowed = ", ".join(f"'{u.value}'" for u in units)
        raise ValueError(f"EMA {option}: unit of {value!r} must be one of {allowed}")
    return time


class EMA(Algorithm):
    """Exponential moving average of the trainable weights in one fp32 copy.

    Args:
        half_life: time string, ``"<n>ba"`` or ``"<n>ep"`` with n > 0: the age, in the units of
            ``update_interval``, at which a parameter snapshot's weight in the average halves.
            Gives ``smoothing = 2 ** (-update_interval / half_life)``. Ignored when ``smoothing`` is
            given and ``half_life`` is left at its default. Default ``"1000ba"``.
        smoothing: the weight of the old average at each update, in [0, 1). Overrides the default
            ``half_life``; it is per update, so it is not rescaled by ``update_interval``.
        ema_start: time string (``ba``, ``ep`` or ``dur``): training completed before the
            average starts. The shadow is a copy of the parameters at the first update event at or
            after it. Default ``"0ba"`` (the weights after the first optimizer step).
        update_interval: time string, ``"<n>ba"`` or ``"<n>ep"`` with n > 0: update when the number
            of completed batches (epochs) is a multiple of n. Must have ``half_life``'s unit.
            Default ``"1ba"``.
        export_dir: if set, at ``Event.FIT_END`` the averaged denoiser is written there as a diffusers
            folder (see :meth:`export_denoiser`).
        export_submodule: the attribute of the (unwrapped) model exported to ``export_dir``: the
            denoiser's (``DiffusionModel.denoiser_name``). Default ``"unet"``.
    """

    def __init__(
        self,
        half_life: Optional[str] = "1000ba",
        smoothing: Optional[float] = None,
        ema_start: str = "0ba",
        update_interval: str = "1ba",
        export_dir: Optional[str] = None,
        export_submodule: str = "unet",
    ):
        self._args = dict(half_life=half_life, smoothing=smoothing, ema_start=ema_start,
                          update_interval=update_interval, export_dir=export_dir, export_submodule=export_submodule)
        units = (TimeUnit.BATCH, TimeUnit.EPOCH)
        self.update_interval = _parse_time("update_interval", update_interval, units)
        if self.update_interval.value <= 0:
            raise ValueError(f"EMA update_interval: must be positive, got {update_interval!r}")
        self.ema_start = _parse_time("ema_start", ema_start, units + (TimeUnit.DURATION,))
        if self.ema_start.value < 0 or (self.ema_start.unit == TimeUnit.DURATION and self.ema_start.value > 1):
            raise ValueError(f"EMA ema_start: must be >= 0 (and <= 1dur), got {ema_start!r}")

        if smoothing is not None:
            if half_life is not None and half_life != "1000ba":
                raise ValueError("EMA smoothing: give either smoothing or half_life, not both (use half_life=None)")
            if isinstance(smoothing, bool) or not isinstance(smoothing, (int, float)) or not 0.0 <= smoothing < 1.0:
                raise ValueError(f"EMA smoothing: must be a float in [0, 1), got {smoothing!r}")
            self.half_life: Optional[Time] = None
            self.smoothing = float(smoothing)
        elif half_life is None:
            raise ValueError("EMA half_life: give a half-life such as '1000ba', or a smoothing")
        else:
            self.half_life = _parse_time("half_life", half_life, units)
            if self.half_life.value <= 0:
                raise ValueError(f"EMA half_life: must be positive, got {half_life!r}")
            if self.half_life.unit != self.update_interval.unit:
                raise ValueError(f"EMA half_life: unit of {half_life!r} must match update_interval {update_interval!r}")
            self.smoothing = 2.0 ** (-self.update_interval.value / self.half_life.value)
        if export_dir is not None and not isinstance(export_dir, (str, os.PathLike)):
            raise ValueError(f"EMA export_dir: expected a path, got {export_dir!r}")
        self.export_dir = export_dir
        self.export_submodule = export_submodule
        self._update_event = Event.BATCH_END if self.update_interval.unit == TimeUnit.BATCH else Event.EPOCH_END

        # Serialized state.
        self.shadow: dict[str, torch.Tensor] = {}  # name -> fp32 tensor shaped like the local parameter
        self.initialized = False  # True once the shadow holds an average (set at the first update)
        self.num_updates = 0  # updates since initialization (the copy at initialization not counted)

        # Binding to the model: parameter objects in name order, and the update's tensor groups.
        self._model_ref: Optional[weakref.ref] = None
        self._names: list[str] = []
        self._params: list[torch.Tensor] = []
        self._groups: list[tuple[list[torch.Tensor], list[torch.Tensor], bool]] = []
        self._has_dtensor = False
        self._sharded = False
        self._swapped = False

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self._args.items())
        return f"EMA({args})"

    # ----------------------------------------------------------------------------------- events

    def match(self, event: Event, state: State) -> bool:
        if event == self._update_event:
            return self._update_due(state)
        if event == Event.FIT_START:
            return True
        if event == Event.FIT_END:
            return self.export_dir is not None
        return False

    def apply(self, event: Event, state: State, logger: Logger) -> None:
        if event == self._update_event:
            self._bind(state.model)
            self.update()
        elif event == Event.FIT_START:
            # After a checkpoint load the shadow is on the CPU; here the model is in its final
            # (device-placed, DDP/FSDP-wrapped) form, so names, shapes and devices can be checked.
            self._bind(state.model, force=True)
        elif event == Event.FIT_END:
            assert self.export_dir is not None
            if not self.initialized:
                warnings.warn(f"EMA: training ended before ema_start={self._args['ema_start']!r}; nothing exported")
                return
            self.export_denoiser(state.model, self.export_dir, submodule=self.export_submodule)

    def _update_due(self, state: State) -> bool:
        if not self.initialized:
            if self.ema_start.unit == TimeUnit.DURATION:
                elapsed = state.get_elapsed_duration()
                return elapsed is not None and elapsed >= self.ema_start
            return state.timestamp.get(self.ema_start.unit).value >= self.ema_start.value
        return state.timestamp.get(self.update_interval.unit).value % self.update_interval.value == 0

    # ----------------------------------------------------------------------------------- update

    @torch.no_grad()
    def update(self, model: Optional[torch.nn.Module] = None) -> None:
        """One EMA step on the bound model (or on ``model``): copy on the first call, lerp after.

        Cost per step with fp32 parameters: one ``torch._foreach_lerp_`` over all trainable tensors
        (read shadow + param, write shadow: 12 bytes of memory traffic per parameter, no temporaries).
        Non-fp32 parameters (e.g. bf16) are first cast to fp32 in chunks of 2**25 elements: one more
        read of the parameter and a write+read of a temporary of at most 128 MiB.
        """
        if model is not None:
            self._bind(model)
        if self._model_ref is None:
            raise RuntimeError("EMA.update: no model bound; pass the model")
        if self._swapped:
            raise RuntimeError("EMA.update: called inside averaged_weights(); the model holds the average")
        if not self.initialized:
            self._initialize()
            return
        weight = 1.0 - self.smoothing  # lerp(shadow, param, w) = shadow + w * (param - shadow)
        for shadow, params, cast in self._groups:  # one group unless dtypes differ or chunking casts
            if self._has_dtensor:
                params = [p.to_local() for p in params]
            if cast:
                params = [p.float() for p in params]
            torch._foreach_lerp_(shadow, params, weight)
        self.num_updates += 1

    def _initialize(self) -> None:
        """Shadow := parameters, in fp32 (a one-time copy, tensor by tensor)."""
        self.shadow = {n: torch.empty_like(_local(p), dtype=torch.float32).copy_(_local(p))
                       for n, p in zip(self._names, self._params)}
        self._build_groups()
        self.initialized = True
        self.num_updates = 0

    def _bind(self, model: torch.nn.Module, force: bool = False) -> None:
        """Collect the trainable parameters of ``model`` by name; check and place the shadow."""
        if not force and self._model_ref is not None and self._model_ref() is model:
            return
        names, params = [], []
        for name, p in _unwrap(model).named_parameters():
            if p.requires_grad:
                names.append(_clean_name(name))
                params.append(p)
        if len(set(names)) != len(names):
            raise ValueError("EMA: trainable parameter names collide after removing wrapper prefixes")
        self._model_ref = weakref.ref(model)
        self._names, self._params = names, params
        self._has_dtensor = _DTensor is not None and any(isinstance(p, _DTensor) for p in params)
        self._sharded = _is_sharded(model, params)
        if self.shadow:
            self._place_shadow()
            self._build_groups()

    def _place_shadow(self) -> None:
        """Check a loaded shadow against the model and move it to the parameters' devices."""
        missing = [n for n in self._names if n not in self.shadow]
        unexpected = [n for n in self.shadow if n not in set(self._names)]
        if missing or unexpected:
            raise ValueError(f"EMA: the EMA state does not match the model's trainable parameters: "
                             f"missing {missing[:3]}{'...' if len(missing) > 3 else ''}, "
                             f"unexpected {unexpected[:3]}{'...' if len(unexpected) > 3 else ''}")
        for n, p in zip(self._names, self._params):
            local, s = _local(p), self.shadow[n]
            if _DTensor is not None and isinstance(p, _DTensor) and s.shape == p.shape != local.shape:
                # A whole tensor (saved by _full_shadow or by an unsharded run): keep this rank's part.
                # src_data_rank=None: every rank cuts its own part from its own copy, no communication.
                part = distribute_tensor(s.to(local.device), p.device_mesh, p.placements, src_data_rank=None)
                s = self.shadow[n] = part.to_local().clone()  # a copy: a view would keep the whole tensor
            if s.shape != local.shape:
                raise ValueError(f"EMA: shadow of {n} has shape {tuple(s.shape)}, parameter {tuple(local.shape)} "
                                 "(a different FSDP layout or world size?)")
            if s.device != local.device:
                self.shadow[n] = s.to(local.device)

    def _build_groups(self) -> None:
        """Split the tensors into the lists the update hands to ``_foreach_lerp_``.

        fp32 parameters form one group (one fused call). Others are cast to fp32 during the update,
        so they are cut into chunks of at most ``_CAST_CHUNK_NUMEL`` elements to bound the temporary.
        """
        fp32 = ([], [])
        groups: list[tuple[list[torch.Tensor], list[torch.Tensor], bool]] = []
        chunk: tuple[list, list] = ([], [])
        chunk_numel = 0
        for n, p in zip(self._names, self._params):
            s = self.shadow[n]
            if p.dtype == torch.float32:
                fp32[0].append(s)
                fp32[1].append(p)
                continue
            if chunk[0] and chunk_numel + s.numel() > _CAST_CHUNK_NUMEL:
                groups.append((chunk[0], chunk[1], True))
                chunk, chunk_numel = ([], []), 0
            chunk[0].append(s)
            chunk[1].append(p)
            chunk_numel += s.numel()
        if chunk[0]:
            groups.append((chunk[0], chunk[1], True))
        if fp32[0]:
            groups.insert(0, (fp32[0], fp32[1], False))
        self._groups = groups

    @property
    def shadow_nbytes(self) -> int:
        """Bytes held by the shadow on this rank (4 per local trainable parameter element)."""
        return sum(t.numel() * t.element_size() for t in self.shadow.values())

    # ------------------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        """The shadow (live tensors, not copies: saving costs no extra copy) and the counters.

        Under FSDP each rank's shadow is a different shard, but Composer writes the algorithms'
        state from global rank 0 only (monolithic checkpoints are rank 0's file; in sharded ones the
        algorithm list is one pickled entry, deduplicated to rank 0). So with sharded parameters this
        gathers to rank 0 on the CPU: for FSDP2 the whole tensors (``shadow``, see
        :meth:`_full_shadow`), for FSDP1 every rank's flat shards (``shadow_shards``, indexed by
        rank). A collective that all ranks enter, as they do when Composer saves a checkpoint; it
        costs one CPU copy of the shadow on rank 0 for the time of the save.
        """
        if self._swapped:
            raise RuntimeError("EMA.state_dict: called inside averaged_weights(); the shadow holds training weights")
        sd = super().state_dict()  # {'repr': ...}
        sd.update(format=_FORMAT, initialized=self.initialized, num_updates=self.num_updates,
                  smoothing=self.smoothing, world_size=dist.get_world_size())
        if self._has_dtensor:
            sd["shadow"] = self._full_shadow()
        elif self._sharded and dist.get_world_size() > 1:
            sd["shadow_shards"] = self._gather_shards()
        else:
            sd["shadow"] = dict(self.shadow)
        return sd

    def _full_shadow(self, prefix: str = "") -> dict[str, torch.Tensor]:
        """FSDP2: the whole shadow tensors (names starting with ``prefix``) on rank 0's CPU, {} elsewhere.

        Each local shard is put back in its parameter's DTensor layout (mesh, placements, global
        shape) and all-gathered, one tensor at a time, so the transient is one full tensor per rank.
        Every rank must call it (a collective per tensor, in the same name order on every rank).
        The result is laid out as an unsharded run's shadow: the same checkpoint resumes under DDP,
        under FSDP on another number of ranks, and export.py reads it.
        """
        full: dict[str, torch.Tensor] = {}
        if not self.shadow:
            return full
        rank0 = dist.get_global_rank() == 0
        for name, param in zip(self._names, self._params):
            if not name.startswith(prefix):
                continue
            shadow = self.shadow[name]
            if isinstance(param, _DTensor):
                shadow = _DTensor.from_local(shadow, param.device_mesh, param.placements, run_check=False,
                                             shape=param.shape, stride=param.stride()).full_tensor()
            if rank0:
                full[name] = shadow.detach().cpu()
        return full

    def _gather_shards(self) -> Optional[list[dict[str, torch.Tensor]]]:
        import torch.distributed as torch_dist
        local = {n: t.detach().cpu() for n, t in self.shadow.items()}
        gathered = [None] * dist.get_world_size() if dist.get_global_rank() == 0 else None
        torch_dist.gather_object(local, gathered, dst=0)
        return gathered

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned; the shadow is copied bit for bit.

        Tensors stay where the checkpoint put them (the CPU) until the model is bound
        (``Event.FIT_START``), which moves them next to the parameters and checks names and shapes.
        """
        if state.get("format") != _FORMAT:
            raise ValueError("EMA: the checkpoint's 'EMA' entry is not this EMA's state (saved by "
                             "composer.algorithms.EMA?); pass load_exclude_algorithms or start without it")
        if "shadow_shards" in state:  # saved from FSDP shards: take this rank's part
            shards = state["shadow_shards"]
            if not shards or len(shards) != dist.get_world_size():
                raise ValueError(f"EMA: the checkpoint holds FSDP shards of world size {state.get('world_size')}, "
                                 f"this run has {dist.get_world_size()}: the EMA cannot be re-sharded")
            loaded = shards[dist.get_global_rank()]
        else:
            loaded = state["shadow"]
        if any(t.dtype != torch.float32 for t in loaded.values()):
            raise ValueError("EMA: the checkpoint's shadow is not fp32")
        self.shadow = dict(loaded)
        self._groups = []
        self.initialized = bool(state["initialized"])
        self.num_updates = int(state["num_updates"])
        if state.get("smoothing") != self.smoothing:
            warnings.warn(f"EMA: the checkpoint was averaged with smoothing {state.get('smoothing')}, "
                          f"continuing with {self.smoothing}")
        model = self._model_ref() if self._model_ref is not None else None
        if model is not None and self.shadow:
            self._bind(model, force=True)

    # ---------------------------------------------------------------------------- using the EMA

    @contextlib.contextmanager
    def averaged_weights(self, model: torch.nn.Module, prefix: str = "") -> Iterator[torch.nn.Module]:
        """Put the averaged weights into ``model`` (cast to each parameter's dtype); restore on exit.

        Only parameters whose shadow name starts with ``prefix`` (e.g. ``"unet."``) are swapped.
        fp32 parameters are exchanged with their shadow tensor by tensor (transient memory: one
        tensor), so no second copy of the model is kept; for other dtypes the training values are
        stashed in their own dtype (e.g. 2 bytes per bf16 parameter) because the cast is lossy.
        The training weights come back bit for bit. Do not train or checkpoint inside the block.
        """
        if not self.initialized:
            raise RuntimeError("EMA.averaged_weights: the average has not started yet (see ema_start)")
        if self._swapped:
            raise RuntimeError("EMA.averaged_weights: already active")
        pairs = []
        for name, p in _unwrap(model).named_parameters():
            name = _clean_name(name)
            if p.requires_grad and name.startswith(prefix):
                if name not in self.shadow:
                    raise ValueError(f"EMA.averaged_weights: no shadow for parameter {name}")
                pairs.append((_local(p), self.shadow[name]))
        stash: dict[int, torch.Tensor] = {}
        done = 0
        self._swapped = True
        try:
            with torch.no_grad():
                for i, (param, shadow) in enumerate(pairs):
                    training = param.detach().clone()
                    param.copy_(shadow)
                    if param.dtype == torch.float32:
                        shadow.copy_(training)  # the shadow slot keeps the training weights meanwhile
                    else:
                        stash[i] = training
                    done = i + 1
            yield model
        finally:
            with torch.no_grad():
                for i, (param, shadow) in enumerate(pairs[:done]):
                    if i in stash:
                        param.copy_(stash.pop(i))
                    else:
                        average = param.detach().clone()
                        param.copy_(shadow)
                        shadow.copy_(average)
            self._swapped = False

    def export_denoiser(self, model: torch.nn.Module, save_directory: str | os.PathLike, submodule: str = "unet",
                        dtype: torch.dtype = torch.float32) -> None:
        """Write the averaged ``model.<submodule>`` (the denoiser) as a diffusers folder (config.json + safetensors).

        Load it with its class's ``from_pretrained(save_directory)``. Weights are written in
        ``dtype`` (default fp32: the shadow as is); the submodule's frozen parameters and buffers, if
        any, are written as they are in the model. Global rank 0 writes; call it on every rank.
        Without FSDP the state dict references the shadow (no copy). With FSDP the averaged shards
        are gathered to rank 0 on the CPU (FSDP2: the shadow tensor by tensor; FSDP1: swapped into
        the model and gathered with it), once, at export.
        """
        module = getattr(_unwrap(model), submodule)
        prefix = submodule + "."
        self._bind(model)
        if self._has_dtensor:
            if not self.initialized:
                raise RuntimeError("EMA.export_denoiser: the average has not started yet (see ema_start)")
            full = self._full_shadow(prefix)  # the average, gathered tensor by tensor
            weights = {}
            for k, v in module.state_dict().items():  # in the same order on every rank
                k = _clean_name(k)
                if prefix + k in self.shadow:
                    weights[k] = full.get(prefix + k)
                else:  # frozen parameters and buffers as they are in the model
                    weights[k] = v.full_tensor() if isinstance(v, _DTensor) else v
        elif self._sharded:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
            # cpu_offload gathers to rank 0's CPU; with CPU parameters it is not needed (and FSDP1's
            # offload path crashes on CPU-only runs in torch 2.7), so every rank gathers in place.
            on_gpu = any(_local(p).device.type != "cpu" for p in self._params)
            with self.averaged_weights(model, prefix=prefix):
                full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=on_gpu))
            weights = {_clean_name(k)[len(prefix):]: v for k, v in full.items() if _clean_name(k).startswith(prefix)}
        else:
            if not self.initialized:
                raise RuntimeError("EMA.export_denoiser: the average has not started yet (see ema_start)")
            weights = {}
            for k, v in module.state_dict().items():
                k = _clean_name(k)
                weights[k] = self.shadow.get(prefix + k, v)
        if dist.get_global_rank() == 0:
            _write_diffusers_folder(module, weights, save_directory, dtype)
        dist.barrier()


def _write_diffusers_folder(module: torch.nn.Module, weights: dict[str, torch.Tensor],
                            save_directory: str | os.PathLike, dtype: torch.dtype) -> None:
    """The layout of diffusers' ``save_pretrained``: ``config.json`` + ``diffusion_pytorch_model.safetensors``."""
    from safetensors.torch import save_file
    os.makedirs(save_directory, exist_ok=True)
    if not hasattr(module, "save_config"):
        raise ValueError(f"EMA export: {type(module).__name__} is not a diffusers model (no save_config)")
    module.save_config(save_directory)
    tensors = {}
    for k, v in weights.items():
        v = v.detach()
        if v.is_floating_point():
            v = v.to(dtype)
        tensors[k] = v.to("cpu").contiguous()  # no copy for contiguous CPU tensors already in dtype
    save_file(tensors, os.path.join(save_directory, "diffusion_pytorch_model.safetensors"), metadata={"format": "pt"})
