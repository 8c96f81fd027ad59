"""VGG416: VGG-16 deepened to 416 weight layers, in plain PyTorch; also a model file.

The Harmony paper (§5.1) uses "a variant of the classic VGG model scaled to have 416 layers", as
in vDNN (Rhu et al., MICRO'16), which built VGG-116/216/316/416 by adding 20/40/60/80 extra 3x3
convolutions to each of VGG-16's five convolution groups. VGG416 is therefore VGG-16's stages
(2, 2, 3, 3, 3 convs at 64, 128, 256, 512, 512 channels) with 80 more convs each:
82 + 82 + 83 + 83 + 83 = 413 convolutions plus the 3 fully connected layers = 416 weight layers.
There is no BatchNorm, as in the original VGG. ImageNet shapes (224x224, 1000 classes), SGD.

Each conv + ReLU pair is one ``ConvReLU`` element of its stage, so a "layer" Harmony sees is one
conv block; stages end with a max-pool.

Usage as a model file: ``harmony compile models/vgg.py --arg preset=vgg416``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from harmony.models.common import class_images, resolve_dtype, resolve_preset


@dataclass(frozen=True)
class VGGConfig:
    """Shape of a VGG: convs per stage, channels per stage, classifier width, image size."""

    depths: tuple[int, ...]
    channels: tuple[int, ...]
    fc_width: int = 4096
    num_classes: int = 1000
    image_size: int = 224
    pool_size: int = 7  # spatial size the classifier sees (224 / 2**5 = 7 for ImageNet)
    dropout: float = 0.5

    @property
    def num_weight_layers(self) -> int:
        """Convolutions plus the three fully connected layers (the "416" of VGG416)."""
        return sum(self.depths) + 3


PRESETS: dict[str, VGGConfig] = {
    # 6 convs + 3 fc, 32x32 images, 10 classes: 22,362 parameters; for tests.
    "tiny": VGGConfig(depths=(1, 1, 2, 1, 1), channels=(8, 16, 16, 32, 32), fc_width=32,
                      num_classes=10, image_size=32, pool_size=1),
    # VGG-16 + 80 convs per stage: 413 convs + 3 fc = 416 layers, 577,894,184 parameters.
    "vgg416": VGGConfig(depths=(82, 82, 83, 83, 83), channels=(64, 128, 256, 512, 512)),
}


class ConvReLU(nn.Sequential):
    """One VGG layer: 3x3 convolution (padding 1, keeps the size) followed by ReLU."""

    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__(nn.Conv2d(in_channels, out_channels, kernel_size=3, padding=1),
                         nn.ReLU())


class VGG(nn.Module):
    """VGG classifier: images (B, 3, S, S) -> class logits (B, num_classes)."""

    def __init__(self, config: VGGConfig) -> None:
        super().__init__()
        if len(config.depths) != len(config.channels):
            raise ValueError("depths and channels must have one entry per stage")
        self.config = config
        stages = []
        in_ch = 3
        for depth, out_ch in zip(config.depths, config.channels):
            blocks = [ConvReLU(in_ch if i == 0 else out_ch, out_ch) for i in range(depth)]
            stages.append(nn.Sequential(*blocks, nn.MaxPool2d(kernel_size=2, stride=2)))
            in_ch = out_ch
        self.features = nn.Sequential(*stages)
        self.avgpool = nn.AdaptiveAvgPool2d(config.pool_size)
        self.flatten = nn.Flatten(1)
        self.classifier = nn.Sequential(
            nn.Linear(in_ch * config.pool_size ** 2, config.fc_width),
            nn.ReLU(),
            nn.Dropout(config.dropout),
            nn.Linear(config.fc_width, config.fc_width),
            nn.ReLU(),
            nn.Dropout(config.dropout),
            nn.Linear(config.fc_width, config.num_classes),
        )
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """torchvision's VGG init (Kaiming for convs, N(0, 0.01) for fc); in place, meta-safe."""
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
                nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, 0.0, 0.01)
                nn.init.zeros_(module.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.flatten(self.avgpool(self.features(x))))


def build_model(preset: str = "tiny", dtype: str = "float32", dropout: float | None = None,
                **_) -> VGG:
    """VGG of the named preset; ``dropout=None`` keeps VGG's 0.5 in the classifier."""
    config = resolve_preset(PRESETS, preset, "VGG")
    if dropout is not None:
        config = replace(config, dropout=float(dropout))
    return VGG(config).to(dtype=resolve_dtype(dtype))


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean cross entropy over the samples."""
    return F.cross_entropy(output, target)


def get_batch(batch_size: int, step: int, preset: str = "tiny", dtype: str = "float32",
              **_) -> tuple[torch.Tensor, torch.Tensor]:
    """(images (B, 3, S, S) of ``dtype``, labels (B,) int64); depends only on the arguments."""
    config = resolve_preset(PRESETS, preset, "VGG")
    return class_images(batch_size, 3, config.image_size, config.num_classes, step,
                        resolve_dtype(dtype))


def build_optimizer(params, lr: float = 0.01, momentum: float = 0.9, weight_decay: float = 0.0,
                    **_) -> torch.optim.Optimizer:
    """SGD with momentum, as the paper trains VGG416 with SGD (§5.1)."""
    return torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay)
