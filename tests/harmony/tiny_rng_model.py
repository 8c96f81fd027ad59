"""A tiny float64 model file for the checkpoint, signal and fuzz tests: dropout, and a get_batch that
draws from the global generators of torch, numpy and Python (a resume must restore all three)."""
import random

import numpy as np
import torch
from torch import nn


def build_model():
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Dropout(0.2), nn.Linear(16, 16), nn.Tanh(),
                         nn.Linear(16, 3)).double()


def loss_fn(output, target):
    return ((output - target) ** 2).mean()


def get_batch(batch_size, step):
    x = torch.randn(batch_size, 6, dtype=torch.float64) + float(np.random.rand()) + random.random()
    return x, torch.randn(batch_size, 3, dtype=torch.float64)


def build_optimizer(params):
    return torch.optim.Adam(params, lr=1e-2)
