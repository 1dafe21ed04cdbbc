"""Test setup: Triton kernels run in its interpreter on machines without CUDA."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
