"""A Llama-style block under a torchtitan-style tensor + sequence parallel plan, for
``python -m commfuse_compile explain``::

    python -m commfuse_compile explain examples/llama_block.py build --world-size 8
    python -m commfuse_compile explain examples/llama_block.py build --options '{"profile": "l40s-pcie"}' --trace llama.json

``build(world_size)`` is called inside a fake process group of that size and returns the
parallelised block and a [batch, seq / world_size, dim] input shard.
"""

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import parallelize_module

from commfuse_compile.models import Block, tp_plan

DIM, HEADS, FFN, BATCH, SEQ = 1024, 8, 4096, 1, 4096


def build(world_size: int):
    """The block parallelised over ``world_size`` ranks, and this rank's input shard."""
    block = parallelize_module(Block(DIM, HEADS, FFN), init_device_mesh("cpu", (world_size,)), tp_plan())
    return block, (torch.randn(BATCH, SEQ // world_size, DIM),)
