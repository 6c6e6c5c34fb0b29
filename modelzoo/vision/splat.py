"""Split-attention convolution and DropBlock, the reusable layers of ResNeSt.

Split attention is from Zhang et al., "ResNeSt: Split-Attention Networks" (2020),
https://arxiv.org/abs/2004.08955. DropBlock is from Ghiasi et al., "DropBlock: A
regularization method for convolutional networks" (NeurIPS 2018),
https://arxiv.org/abs/1810.12890.

Parameter names follow the official ResNeSt PyTorch release (``conv``, ``bn0``, ``fc1``,
``bn1``, ``fc2``) so its state dicts load with ``strict=True``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["DropBlock2d", "RadixSoftmax", "SplitAttnConv2d", "set_dropblock_prob"]


class DropBlock2d(nn.Module):
    """DropBlock: drops contiguous ``block_size x block_size`` regions of a feature map.

    During training, seed positions are drawn with probability
    ``gamma = p / block_size**2 * (H * W) / ((H - block_size + 1) * (W - block_size + 1))``
    (the paper's Eq. 1, for rectangular maps) among the positions where a whole block fits,
    each seed is grown to a block by max-pooling, and the kept activations are rescaled by
    ``numel / kept`` so the expected sum is unchanged. At evaluation it is the identity.

    ``drop_prob`` is the current drop probability; ``max_drop_prob`` the value it ramps to.
    Schedulers call :func:`set_dropblock_prob` (GluonCV's ``DropBlockScheduler`` behaviour:
    the paper ramps ``p`` linearly from 0 during training).

    Args:
        drop_prob: The target probability of dropping an activation.
        block_size: Side of the square block (ResNeSt uses 3).

    Shape:
        Input and output: ``(B, C, H, W)``.
    """

    def __init__(self, drop_prob: float, block_size: int = 3) -> None:
        super().__init__()
        if not 0.0 <= drop_prob < 1.0:
            raise ValueError(f"DropBlock2d: drop_prob must be in [0, 1), got {drop_prob}")
        if block_size < 1 or block_size % 2 == 0:
            raise ValueError(
                f"DropBlock2d: block_size must be a positive odd number, got {block_size}"
            )
        self.max_drop_prob = float(drop_prob)
        self.drop_prob = float(drop_prob)
        self.block_size = block_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.drop_prob == 0.0:
            return x
        _, _, height, width = x.shape
        bs = min(self.block_size, height, width)
        bs -= 1 - bs % 2  # an odd size keeps the mask the map's size on small maps
        valid_h = height - bs + 1
        valid_w = width - bs + 1
        gamma = self.drop_prob / (bs * bs) * (height * width) / (valid_h * valid_w)
        # Seeds only where a full block fits, so every dropped block lies inside the map.
        seeds = torch.rand(
            (x.shape[0], x.shape[1], valid_h, valid_w), dtype=torch.float32, device=x.device
        )
        seeds = (seeds < gamma).to(x.dtype)
        pad = bs // 2
        seeds = F.pad(seeds, (pad, width - valid_w - pad, pad, height - valid_h - pad))
        block_mask = F.max_pool2d(seeds, kernel_size=bs, stride=1, padding=pad)
        keep = 1.0 - block_mask  # (B, C, H, W)
        kept = keep.sum().clamp_min(1.0)
        return x * keep * (keep.numel() / kept)

    def extra_repr(self) -> str:
        return f"drop_prob={self.drop_prob}, max_drop_prob={self.max_drop_prob}, block_size={self.block_size}"


def set_dropblock_prob(model: nn.Module, fraction: float) -> float:
    """Sets every DropBlock in ``model`` to ``fraction`` of its maximum drop probability.

    A linear ramp is ``set_dropblock_prob(model, min(1, epoch / ramp_epochs))``; GluonCV's
    recipe ramps over the whole training run.

    Args:
        model: Any module containing :class:`DropBlock2d` layers.
        fraction: In ``[0, 1]``.

    Returns:
        The largest drop probability now in effect (0.0 when the model has no DropBlock).
    """
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"set_dropblock_prob: fraction must be in [0, 1], got {fraction}")
    current = 0.0
    for module in model.modules():
        if isinstance(module, DropBlock2d):
            module.drop_prob = module.max_drop_prob * fraction
            current = max(current, module.drop_prob)
    return current


class RadixSoftmax(nn.Module):
    """Softmax across the radix splits of each cardinal group (sigmoid when radix is 1).

    Shape:
        Input: ``(B, cardinality * radix * C, 1, 1)``; output: ``(B, radix * cardinality * C)``
        ordered radix-major, matching how the splits are summed.
    """

    def __init__(self, radix: int, cardinality: int) -> None:
        super().__init__()
        self.radix = radix
        self.cardinality = cardinality

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch = x.shape[0]
        if self.radix == 1:
            return torch.sigmoid(x).reshape(batch, -1)
        x = x.reshape(batch, self.cardinality, self.radix, -1)  # (B, G, R, C/G)
        x = x.transpose(1, 2)  # (B, R, G, C/G)
        x = F.softmax(x, dim=1)
        return x.reshape(batch, -1)


class SplitAttnConv2d(nn.Module):
    """Split-attention convolution (the paper's Fig. 2, radix-major layout).

    A grouped ``k x k`` convolution produces ``radix`` splits per cardinal group; their sum is
    globally pooled, passed through ``fc1`` (1x1 conv, ``max(in * radix // reduction, 32)``
    channels) + BN + ReLU and ``fc2``, and an r-softmax over the radix dimension weights the
    splits, which are summed.

    Args:
        in_channels: Input channels.
        out_channels: Output channels (the group width).
        kernel_size, stride, padding, dilation: Of the grouped convolution.
        groups: The cardinality.
        radix: Splits per cardinal group; 1 makes it a squeeze-excitation-like gate.
        reduction_factor: Bottleneck reduction of the attention MLP.
        min_inter_channels: Lower bound of the attention MLP width.
        dropblock_prob: DropBlock after the grouped convolution's BN (0 disables it).

    Shape:
        Input ``(B, in_channels, H, W)``; output ``(B, out_channels, H / stride, W / stride)``.
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int = 3,
        stride: int = 1,
        padding: int = 1,
        dilation: int = 1,
        groups: int = 1,
        radix: int = 2,
        reduction_factor: int = 4,
        min_inter_channels: int = 32,
        dropblock_prob: float = 0.0,
    ) -> None:
        super().__init__()
        if radix < 1:
            raise ValueError(f"SplitAttnConv2d: radix must be >= 1, got {radix}")
        if groups < 1 or out_channels % groups:
            raise ValueError(
                f"SplitAttnConv2d: out_channels ({out_channels}) must be divisible by the "
                f"cardinality ({groups})"
            )
        inter_channels = max(in_channels * radix // reduction_factor, min_inter_channels)
        if inter_channels % groups:
            raise ValueError(
                f"SplitAttnConv2d: the attention width {inter_channels} is not divisible by the "
                f"cardinality ({groups}); choose a cardinality that divides it"
            )
        self.radix = radix
        self.cardinality = groups
        self.out_channels = out_channels
        self.conv = nn.Conv2d(
            in_channels,
            out_channels * radix,
            kernel_size,
            stride=stride,
            padding=padding,
            dilation=dilation,
            groups=groups * radix,
            bias=False,
        )
        self.bn0 = nn.BatchNorm2d(out_channels * radix)
        self.dropblock = DropBlock2d(dropblock_prob, 3) if dropblock_prob > 0 else nn.Identity()
        self.relu = nn.ReLU(inplace=True)
        self.fc1 = nn.Conv2d(out_channels, inter_channels, 1, groups=groups)
        self.bn1 = nn.BatchNorm2d(inter_channels)
        self.fc2 = nn.Conv2d(inter_channels, out_channels * radix, 1, groups=groups)
        self.rsoftmax = RadixSoftmax(radix, groups)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv(x)  # (B, R*C, H, W)
        x = self.bn0(x)
        x = self.dropblock(x)
        x = self.relu(x)
        batch, rchannels, height, width = x.shape
        if self.radix > 1:
            splits = x.reshape(batch, self.radix, rchannels // self.radix, height, width)
            gap = splits.sum(dim=1)  # (B, C, H, W)
        else:
            gap = x
        gap = gap.mean((2, 3), keepdim=True)  # (B, C, 1, 1)
        gap = self.fc1(gap)
        gap = self.bn1(gap)
        gap = self.relu(gap)
        attn = self.fc2(gap)  # (B, R*C, 1, 1)
        attn = self.rsoftmax(attn).reshape(batch, -1, 1, 1)
        if self.radix > 1:
            attn = attn.reshape(batch, self.radix, rchannels // self.radix, 1, 1)
            out = (splits * attn).sum(dim=1)  # (B, C, H, W)
        else:
            out = x * attn
        return out.contiguous()
