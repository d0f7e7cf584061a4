"""Training objectives: how clean latents and noise become the denoiser's input and its target.

A model family names its objective (`ModelFamily.objective`). `DDPMObjective` is SD2's (and SDXL's):
integer timesteps uniform over the DDPM schedule, the target the noise (`epsilon`) or the velocity
(`v_prediction`). A rectified-flow objective (Flux.1: interpolate data and noise, the velocity
noise - data as target, timesteps drawn in [0, 1]) is another subclass of `Objective`.
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
        """The loss bin of each timestep (integers 0..num_bins-1)."""
        return (timesteps * num_bins) // self.num_timesteps


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
        snr = self.snr.to(timesteps.device)[timesteps]
        clipped = torch.clamp(snr, max=snr_gamma)
        return clipped / snr if self.prediction_type == "epsilon" else clipped / (snr + 1.0)
