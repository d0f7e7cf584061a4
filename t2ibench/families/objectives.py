"""Training objectives: how clean latents and noise become the denoiser's input and target
(`DDPMObjective`: SD2's and SDXL's; `RectifiedFlowObjective`: Flux.1's).
"""
from __future__ import annotations

import copy
from abc import ABC, abstractmethod

import torch


class Objective(ABC):
    """The noising and the target of one training step.

    `num_timesteps`: the loss-by-timestep bins span timesteps 0..num_timesteps-1 (`bin_index`
    maps a step's timesteps to them, so a continuous-time objective reports on the same scale).
    """

    num_timesteps: int
    # The diffusers scheduler whose config samplers and exported pipelines are built from.
    noise_scheduler: object

    @abstractmethod
    def sample_timesteps(self, batch_size: int, device: torch.device) -> torch.Tensor:
        """One timestep per sample, drawn from the global RNG (Composer seeds and checkpoints it)."""

    @abstractmethod
    def noisy_and_target(self, latents: torch.Tensor, noise: torch.Tensor,
                         timesteps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The denoiser's input and what it should predict, in fp32."""

    @abstractmethod
    def loss_weights(self, timesteps: torch.Tensor, snr_gamma: float) -> torch.Tensor:
        """Per-sample weights of min-SNR-gamma weighting (Hang et al. 2023)."""

    def bin_index(self, timesteps: torch.Tensor, num_bins: int) -> torch.Tensor:
        """The loss bin of each (integer) timestep: floor(t * bins / timesteps), in 0..num_bins-1.

        Integer arithmetic, so that `LossBins.edges` can name exactly the timesteps of each bin.
        """
        return (timesteps * num_bins) // self.num_timesteps

    def fixed_timesteps(self, index: torch.Tensor, num: int) -> torch.Tensor:
        """Timestep k/num of the schedule for each k in `index` (the validation loss's fixed timesteps)."""
        return (index.long() * self.num_timesteps) // num


class DDPMObjective(Objective):
    """Denoising diffusion on diffusers' DDPM schedule: `epsilon` or `v_prediction` targets."""

    def __init__(self, noise_scheduler):
        self.noise_scheduler = copy.deepcopy(noise_scheduler)
        self.num_timesteps = self.noise_scheduler.config.num_train_timesteps
        self.prediction_type = self.noise_scheduler.config.prediction_type
        if self.prediction_type not in ("epsilon", "v_prediction"):
            raise ValueError(f"scheduler prediction_type '{self.prediction_type}' is not supported for training")
        alphas_cumprod = self.noise_scheduler.alphas_cumprod.float()
        self.snr = alphas_cumprod / (1.0 - alphas_cumprod)  # signal-to-noise ratio of each timestep

    def sample_timesteps(self, batch_size: int, device: torch.device) -> torch.Tensor:
        return torch.randint(0, self.num_timesteps, (batch_size,), device=device)

    def noisy_and_target(self, latents: torch.Tensor, noise: torch.Tensor,
                         timesteps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        noisy = self.noise_scheduler.add_noise(latents, noise, timesteps)
        if self.prediction_type == "epsilon":
            return noisy, noise
        return noisy, self.noise_scheduler.get_velocity(latents, noise, timesteps)

    def loss_weights(self, timesteps: torch.Tensor, snr_gamma: float) -> torch.Tensor:
        # min(SNR, gamma) / SNR for epsilon targets, / (SNR + 1) for velocity targets, so the easy
        # low-noise steps stop dominating.
        if self.snr.device != timesteps.device:
            self.snr = self.snr.to(timesteps.device)  # once, as diffusers moves alphas_cumprod: not per microbatch
        snr = self.snr[timesteps]
        clipped = torch.clamp(snr, max=snr_gamma)
        return clipped / snr if self.prediction_type == "epsilon" else clipped / (snr + 1.0)


TIMESTEP_SAMPLINGS = ("uniform", "logit_normal")  # --timestep_sampling


class RectifiedFlowObjective(Objective):
    """Rectified flow (Flux.1, SD3): x_t = (1 - s) x0 + s noise, the target the velocity noise - x0.

    s in [0, 1] is carried as the timestep t = 1000 s, the scale of diffusers' flow-matching
    sampler (FlowMatchEulerDiscreteScheduler) and of the loss-by-timestep bins; the family's
    `predict` hands the denoiser s, as FluxPipeline does. `sampling` draws s as MLPerf's Flux.1
    reference does, `uniform` (torch.rand), or as SD3 does, `logit_normal`: the sigmoid of a normal
    (`logit_mean`, `logit_std`; SD3's 0 and 1), which trains the middle noise levels more often.
    """

    def __init__(self, noise_scheduler, sampling: str = "uniform", logit_mean: float = 0.0, logit_std: float = 1.0):
        if sampling not in TIMESTEP_SAMPLINGS:
            raise ValueError(f"--timestep_sampling '{sampling}' is not one of {TIMESTEP_SAMPLINGS}")
        self.noise_scheduler = copy.deepcopy(noise_scheduler)
        self.num_timesteps = self.noise_scheduler.config.num_train_timesteps
        self.sampling, self.logit_mean, self.logit_std = sampling, logit_mean, logit_std

    def sample_timesteps(self, batch_size: int, device: torch.device) -> torch.Tensor:
        if self.sampling == "uniform":
            s = torch.rand(batch_size, device=device)
        else:
            s = torch.sigmoid(torch.randn(batch_size, device=device) * self.logit_std + self.logit_mean)
        return s * self.num_timesteps

    def noisy_and_target(self, latents: torch.Tensor, noise: torch.Tensor,
                         timesteps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        s = (timesteps.float() / self.num_timesteps).view(-1, *([1] * (latents.dim() - 1)))
        return (1.0 - s) * latents + s * noise, noise - latents

    def loss_weights(self, timesteps: torch.Tensor, snr_gamma: float) -> torch.Tensor:
        raise ValueError("--snr_gamma weights DDPM timesteps by their signal-to-noise ratio; rectified flow has "
                         "no such weighting here")

    def bin_index(self, timesteps: torch.Tensor, num_bins: int) -> torch.Tensor:
        # The integer part of t binned as a DDPM timestep is (`Objective.bin_index`), so that the bins'
        # integer labels (`LossBins.edges`) are exact for continuous t too: bin i holds first <= t < last + 1.
        # t = 1000 exactly (s = 1 after float rounding of the logit-normal's sigmoid) joins the last bin.
        whole = timesteps.float().floor().long()
        return ((whole * num_bins) // self.num_timesteps).clamp_(0, num_bins - 1)

    def fixed_timesteps(self, index: torch.Tensor, num: int) -> torch.Tensor:
        return index.float() * self.num_timesteps / num
