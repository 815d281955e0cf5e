"""Diffusion synthesizer (UNet + EDM preconditioning + sampler) and the auxiliary one-step generator."""

from .auxgen import AuxGenerator
from .edm import (
    EDMDenoiser,
    LossRandomness,
    build_denoiser,
    denoiser_from_spec,
    denoiser_spec,
    draw_loss_randomness,
    edm_loss,
    edm_loss_from_randomness,
    edm_loss_single,
)
from .sampler import generate, karras_sigmas, sample, sampler_step
from .unet import UNet, count_parameters

__all__ = [
    "AuxGenerator",
    "EDMDenoiser",
    "LossRandomness",
    "UNet",
    "build_denoiser",
    "count_parameters",
    "denoiser_from_spec",
    "denoiser_spec",
    "draw_loss_randomness",
    "edm_loss",
    "edm_loss_from_randomness",
    "edm_loss_single",
    "generate",
    "karras_sigmas",
    "sample",
    "sampler_step",
]
