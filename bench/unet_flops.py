"""FLOPs of a diffusers UNet2DConditionModel per image, counted by hand from its config without running it:
the independent check of what torch.utils.flop_counter reports (`ModelFamily.flops_per_image`'s
`denoiser_fwd` and `denoiser_fwd_bwd`). How backward is counted is in docs/sdxl.md ("FLOPs per image").

    python bench/unet_flops.py                                      # sdxl-base at 1024, sd2-base at 512
    python bench/unet_flops.py --model_config sdxl-base --image_size 1024 512 256
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the project root: run as python bench/NAME.py

from t2ibench.core.cli import IMAGE_SIZE, Parser  # noqa: E402

TEXT_TOKENS = 77


class Tally:
    """Forward FLOPs, and the backward FLOPs they imply."""

    def __init__(self) -> None:
        self.forward = 0
        self.backward = 0

    def add(self, flops: int, input_needs_grad: bool = True, has_weight: bool = True) -> None:
        self.forward += flops
        self.backward += flops * (int(has_weight) + int(input_needs_grad))

    def conv(self, c_in: int, c_out: int, kernel: int, out: tuple[int, int], input_needs_grad: bool = True) -> None:
        self.add(2 * c_in * c_out * kernel * kernel * out[0] * out[1], input_needs_grad)

    def linear(self, n_in: int, n_out: int, tokens: int, input_needs_grad: bool = True) -> None:
        self.add(2 * n_in * n_out * tokens, input_needs_grad)

    def attention(self, queries: int, keys: int, width: int) -> None:
        """softmax(Q K^T) V over all heads: two products of queries x keys x width (both operands trained)."""
        self.add(2 * 2 * queries * keys * width, input_needs_grad=True, has_weight=True)


def resnet(t: Tally, c_in: int, c_out: int, side: tuple[int, int], temb: int) -> None:
    t.conv(c_in, c_out, 3, side)
    t.linear(temb, c_out, 1)  # the timestep embedding projected to a per-channel shift
    t.conv(c_out, c_out, 3, side)
    if c_in != c_out:
        t.conv(c_in, c_out, 1, side)  # shortcut


def transformer(t: Tally, channels: int, side: tuple[int, int], depth: int, cross_dim: int, text_tokens: int,
                linear_projection: bool) -> None:
    tokens = side[0] * side[1]
    if linear_projection:
        t.linear(channels, channels, tokens)
    else:
        t.conv(channels, channels, 1, side)
    for _ in range(depth):
        # self-attention: q, k, v, out projections and the two products over all tokens
        for _ in range(4):
            t.linear(channels, channels, tokens)
        t.attention(tokens, tokens, channels)
        # cross-attention: q and out on the image tokens, k and v on the (frozen) text states
        t.linear(channels, channels, tokens)
        t.linear(cross_dim, channels, text_tokens, input_needs_grad=False)
        t.linear(cross_dim, channels, text_tokens, input_needs_grad=False)
        t.attention(tokens, text_tokens, channels)
        t.linear(channels, channels, tokens)
        # GEGLU feed-forward: C -> 2 x 4C (value and gate), 4C -> C
        t.linear(channels, 8 * channels, tokens)
        t.linear(4 * channels, channels, tokens)
    if linear_projection:
        t.linear(channels, channels, tokens)
    else:
        t.conv(channels, channels, 1, side)


def per_level(value, levels: int) -> list:
    return list(value) if isinstance(value, (list, tuple)) else [value] * levels


def unet_flops(config: dict, latent_side: int | tuple[int, int], text_tokens: int = TEXT_TOKENS) -> tuple[int, int]:
    """(forward, forward + backward) FLOPs of one image through the UNet that `config` describes, at
    `latent_side` latent pixels a side, or (height, width) of an aspect-ratio bucket.

    Covers the configurations of this project (SD2, SDXL): DownBlock2D / CrossAttnDownBlock2D,
    their up counterparts, UNetMidBlock2DCrossAttn, positional time embedding, optional
    text_time added embedding. Anything else is refused rather than miscounted.
    """
    channels = list(config["block_out_channels"])
    levels = len(channels)
    layers = config["layers_per_block"]
    depth = per_level(config.get("transformer_layers_per_block", 1), levels)
    cross = config["cross_attention_dim"]
    linear_projection = config.get("use_linear_projection", False)
    down_types, up_types = list(config["down_block_types"]), list(config["up_block_types"])
    for name in down_types + up_types:
        if name not in ("DownBlock2D", "CrossAttnDownBlock2D", "UpBlock2D", "CrossAttnUpBlock2D"):
            raise ValueError(f"unet_flops does not count {name}")
    if config.get("mid_block_type", "UNetMidBlock2DCrossAttn") != "UNetMidBlock2DCrossAttn":
        raise ValueError("unet_flops counts UNetMidBlock2DCrossAttn middle blocks only")
    t = Tally()
    temb = 4 * channels[0]
    t.linear(channels[0], temb, 1, input_needs_grad=False)  # sinusoidal timestep features -> embedding
    t.linear(temb, temb, 1)
    if config.get("addition_embed_type") == "text_time":
        t.linear(config["projection_class_embeddings_input_dim"], temb, 1, input_needs_grad=False)
        t.linear(temb, temb, 1)
    elif config.get("addition_embed_type") is not None:
        raise ValueError(f"unet_flops does not count addition_embed_type {config['addition_embed_type']}")

    side = (latent_side, latent_side) if isinstance(latent_side, int) else tuple(latent_side)
    sizes = []  # the size before each downsampling, which the up path's upsampling restores
    t.conv(config["in_channels"], channels[0], 3, side, input_needs_grad=False)
    skips = [channels[0]]  # channels of each tensor the down path hands to the up path
    c_prev = channels[0]
    for i, kind in enumerate(down_types):
        for j in range(layers):
            resnet(t, c_prev if j == 0 else channels[i], channels[i], side, temb)
            if kind.startswith("CrossAttn"):
                transformer(t, channels[i], side, depth[i], cross, text_tokens, linear_projection)
            skips.append(channels[i])
        c_prev = channels[i]
        if i < levels - 1:
            sizes.append(side)
            # A strided 3x3 convolution padded by 1: an odd side rounds up.
            side = ((side[0] + 1) // 2, (side[1] + 1) // 2)
            t.conv(channels[i], channels[i], 3, side)
            skips.append(channels[i])

    resnet(t, channels[-1], channels[-1], side, temb)
    transformer(t, channels[-1], side, depth[-1], cross, text_tokens, linear_projection)
    resnet(t, channels[-1], channels[-1], side, temb)

    reversed_channels, reversed_depth = channels[::-1], depth[::-1]
    c_prev = reversed_channels[0]
    for i, kind in enumerate(up_types):
        c_out = reversed_channels[i]
        for _ in range(layers + 1):
            resnet(t, c_prev + skips.pop(), c_out, side, temb)
            c_prev = c_out
            if kind.startswith("CrossAttn"):
                transformer(t, c_out, side, reversed_depth[i], cross, text_tokens, linear_projection)
        if i < levels - 1:
            # Nearest upsampling to the skip's size (diffusers passes it: 2x, less one after an odd side),
            # then a convolution at that size.
            side = sizes.pop()
            t.conv(c_out, c_out, 3, side)
    assert not skips, skips
    t.conv(channels[0], config["out_channels"], 3, side)
    return t.forward, t.forward + t.backward


def build_parser() -> Parser:
    p = Parser("unet_flops.py", description=__doc__)
    p.add_argument("--model_config", nargs="+", default=["sdxl-base", "sd2-base"],
                   help="configs to count (any --model_config whose denoiser is a UNet2DConditionModel)")
    p.add_argument("--image_size", type=IMAGE_SIZE, nargs="+", default=None,
                   help="pixels (default: each config's training size, 512 for SD2, 1024 for SDXL)")
    p.add_argument("--no_flop_counter", action="store_true", help="print the hand count only (fast)")
    return p


def main(argv: list[str] | None = None) -> list[dict]:
    args = build_parser().parse_args(argv)
    from t2ibench.families import family_of

    rows = []
    for name in args.model_config:
        family = family_of(name)
        config = dict(family.meta_parts(name).denoiser.config)  # what the family builds, read back
        sizes = args.image_size or [config["sample_size"] * family.latent_downsample]
        for size in sizes:
            fwd, fwd_bwd = unet_flops(config, size // family.latent_downsample)
            row = {"model_config": name, "image_size": size, "hand_fwd": fwd, "hand_fwd_bwd": fwd_bwd}
            if not args.no_flop_counter:
                counted = family.flops_per_image(name, size, vae=False, text_encoders=False)
                row.update(counter_fwd=counted["denoiser_fwd"], counter_fwd_bwd=counted["denoiser_fwd_bwd"])
            rows.append(row)
            line = f"{name} at {size}px: by hand {fwd / 1e9:,.1f} GFLOP fwd, {fwd_bwd / 1e9:,.1f} fwd+bwd"
            if "counter_fwd" in row:
                line += (f"; flop_counter {row['counter_fwd'] / 1e9:,.1f} fwd, {row['counter_fwd_bwd'] / 1e9:,.1f} "
                         f"fwd+bwd (ratio {row['counter_fwd_bwd'] / fwd_bwd:.4f})")
            print(line, flush=True)
    return rows


if __name__ == "__main__":
    main()
