"""torchvision models Harmony's own tests did not write, trained against eager PyTorch.

Each network is torchvision's own, built for 10 classes in float64 and fed CIFAR-sized images
(32x32; GoogLeNet 64x64), compiled at a third of its training footprint on two emulated devices
and trained two steps in pp and in dp (``bench/outside.py``). These are the shapes that broke
Harmony from outside: in-place activations (ShuffleNet, MobileNet, RegNet), a function fx keeps
whole (EfficientNet's stochastic depth) and BatchNorm over a 1x1 map, which trains on no fewer
than two samples (the plan's microbatches then hold two or more). Nothing in these forwards draws
random numbers in a way eager and Harmony would draw differently: stochastic depth and dropout
draw per microbatch from the same seeds (``runtime/rng.py``).

    python -m bench.tv_models [--models regnet_x_400mf,shufflenet_v2_x0_5] [--modes pp,dp] [--markdown out.md]

Needs ``torchvision``. Runs take 10-60 s each on two cores.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from bench import outside
from bench.outside import Case

MINIBATCH, CLASSES = 16, 10


def _network(name: str, size: int = 32, **kwargs: Any) -> Callable[[], Case]:
    def case() -> Case:
        import torchvision

        def build() -> nn.Module:
            torch.manual_seed(0)
            return getattr(torchvision.models, name)(num_classes=CLASSES, **kwargs).double()

        def batch(b: int, step: int) -> tuple:
            g = torch.Generator().manual_seed(step)
            return (torch.randn(b, 3, size, size, generator=g, dtype=torch.float64),
                    torch.randint(0, CLASSES, (b,), generator=g))

        return build, batch, nn.functional.cross_entropy

    return case


CASES: dict[str, Callable[[], Case]] = {
    "resnet18": _network("resnet18"),
    "resnext50_32x4d": _network("resnext50_32x4d"),
    "mobilenet_v2": _network("mobilenet_v2"),
    "mobilenet_v3_small": _network("mobilenet_v3_small"),
    "shufflenet_v2_x0_5": _network("shufflenet_v2_x0_5"),
    "squeezenet1_1": _network("squeezenet1_1"),
    "mnasnet0_5": _network("mnasnet0_5"),
    "efficientnet_b0": _network("efficientnet_b0"),
    "regnet_x_400mf": _network("regnet_x_400mf"),
    "regnet_y_400mf": _network("regnet_y_400mf"),
    "densenet121": _network("densenet121"),
    "googlenet": _network("googlenet", size=64, aux_logits=False, init_weights=True),
    "convnext_tiny": _network("convnext_tiny"),
    "swin_t": _network("swin_t"),
}


COLLECTION = outside.Collection(CASES, MINIBATCH, "torchvision", "bench.tv_models", __doc__)
run, table = COLLECTION.run, COLLECTION.table
main = COLLECTION.main


if __name__ == "__main__":
    main()
