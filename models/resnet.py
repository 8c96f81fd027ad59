"""ResNet1K: a ~1000-layer pre-activation bottleneck ResNet, in plain PyTorch; also a model file.

The Harmony paper (§5.1) names "ResNet1K, a ResNet variant [He et al. 2016a, 2016b]" without its
shape. The 1000-layer ResNet of "Identity Mappings in Deep Residual Networks" (He et al. 2016b) is
the CIFAR-style three-stage network of pre-activation bottleneck blocks with depth 9n + 2
(n blocks per stage, 3 convs each, plus the stem conv and the classifier); ResNet-1001 has n=111.
The project calls the model ResNet-1026; 1026 is not of the form 9n + 2, so the ``resnet1k`` preset
takes the nearest depth at or above it, n = 114: 9 * 114 + 2 = 1028 weight layers (the three 1x1
projection shortcuts not counted, as usual). Change ``blocks_per_stage`` for another depth.

BatchNorm is deliberately present in every block: its running statistics are buffers that
Harmony must carry and update alongside the parameters. Shapes are CIFAR's (32x32, 10 classes);
SGD with momentum, as in the paper's CNN training.

Usage as a model file: ``harmony compile models/resnet.py --arg preset=resnet1k``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from harmony.models.common import class_images, resolve_dtype, resolve_preset

EXPANSION = 4  # a bottleneck block outputs 4x its inner width


@dataclass(frozen=True)
class ResNetConfig:
    """Shape of a CIFAR-style pre-activation bottleneck ResNet."""

    blocks_per_stage: int
    widths: tuple[int, ...] = (16, 32, 64)  # bottleneck widths; stage outputs are 4x these
    stem_channels: int = 16
    num_classes: int = 10
    image_size: int = 32

    @property
    def depth(self) -> int:
        """Weight layers: stem conv + 3 convs per block + the classifier (9n + 2 for 3 stages)."""
        return 3 * self.blocks_per_stage * len(self.widths) + 2


PRESETS: dict[str, ResNetConfig] = {
    # 3 stages x 1 block, 8-channel stem: depth 11, 8,946 parameters; for tests.
    "tiny": ResNetConfig(blocks_per_stage=1, widths=(4, 8, 16), stem_channels=8),
    # n = 114: depth 1028, 10,605,914 parameters.
    "resnet1k": ResNetConfig(blocks_per_stage=114),
}


class PreActBottleneck(nn.Module):
    """BN-ReLU-conv1x1, BN-ReLU-conv3x3 (strided), BN-ReLU-conv1x1, plus the shortcut.

    When the shape changes (first block of a stage) the shortcut is a strided 1x1 convolution of
    the pre-activated input, as in He et al.'s ResNet-1001; otherwise it is the identity.
    """

    def __init__(self, in_channels: int, width: int, stride: int) -> None:
        super().__init__()
        out_channels = width * EXPANSION
        self.bn1 = nn.BatchNorm2d(in_channels)
        self.relu1 = nn.ReLU()
        self.conv1 = nn.Conv2d(in_channels, width, kernel_size=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.relu2 = nn.ReLU()
        self.conv2 = nn.Conv2d(width, width, kernel_size=3, stride=stride, padding=1, bias=False)
        self.bn3 = nn.BatchNorm2d(width)
        self.relu3 = nn.ReLU()
        self.conv3 = nn.Conv2d(width, out_channels, kernel_size=1, bias=False)
        self.shortcut: nn.Module | None = None
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Conv2d(in_channels, out_channels, kernel_size=1, stride=stride,
                                      bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu1(self.bn1(x))
        residual = x if self.shortcut is None else self.shortcut(out)
        out = self.conv1(out)
        out = self.conv2(self.relu2(self.bn2(out)))
        out = self.conv3(self.relu3(self.bn3(out)))
        return out + residual


class ResNet(nn.Module):
    """Pre-activation ResNet: images (B, 3, S, S) -> class logits (B, num_classes)."""

    def __init__(self, config: ResNetConfig) -> None:
        super().__init__()
        self.config = config
        self.conv1 = nn.Conv2d(3, config.stem_channels, kernel_size=3, padding=1, bias=False)
        stages = []
        in_ch = config.stem_channels
        for i, width in enumerate(config.widths):
            blocks = []
            for j in range(config.blocks_per_stage):
                stride = 2 if (i > 0 and j == 0) else 1
                blocks.append(PreActBottleneck(in_ch, width, stride))
                in_ch = width * EXPANSION
            stages.append(nn.Sequential(*blocks))
        self.stages = nn.Sequential(*stages)
        self.bn = nn.BatchNorm2d(in_ch)  # pre-activation nets end with a final BN-ReLU
        self.relu = nn.ReLU()
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.flatten = nn.Flatten(1)
        self.fc = nn.Linear(in_ch, config.num_classes)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """He init for convs, unit BatchNorm, small N(0, 0.01) classifier; in place, meta-safe."""
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(module, nn.BatchNorm2d):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, 0.0, 0.01)
                nn.init.zeros_(module.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stages(self.conv1(x))
        return self.fc(self.flatten(self.avgpool(self.relu(self.bn(x)))))


def build_model(preset: str = "tiny", dtype: str = "float32", dropout: float | None = None,
                **_) -> ResNet:
    """ResNet of the named preset. ResNets have no dropout: ``dropout`` may only be None or 0."""
    config = resolve_preset(PRESETS, preset, "ResNet")
    if dropout:
        raise ValueError(f"ResNet has no dropout layers; got dropout={dropout}")
    return ResNet(config).to(dtype=resolve_dtype(dtype))


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean cross entropy over the samples."""
    return F.cross_entropy(output, target)


def get_batch(batch_size: int, step: int, preset: str = "tiny", dtype: str = "float32",
              **_) -> tuple[torch.Tensor, torch.Tensor]:
    """(images (B, 3, S, S) of ``dtype``, labels (B,) int64); depends only on the arguments."""
    config = resolve_preset(PRESETS, preset, "ResNet")
    return class_images(batch_size, 3, config.image_size, config.num_classes, step,
                        resolve_dtype(dtype))


def build_optimizer(params, lr: float = 0.1, momentum: float = 0.9, weight_decay: float = 1e-4,
                    **_) -> torch.optim.Optimizer:
    """SGD with momentum and weight decay, the ResNet recipe of He et al."""
    return torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay)
