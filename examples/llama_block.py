"""A Llama-style block under a torchtitan-style tensor + sequence parallel plan, for
``python -m commfuse_compile explain``::

    python -m commfuse_compile explain examples/llama_block.py build --world-size 8
    python -m commfuse_compile explain examples/llama_block.py build --options '{"profile": "l40s-pcie"}' --trace llama.json
    python -m commfuse_compile explain examples/llama_block.py build_bf16_on_meta --device cuda --options '{"profile": "h100-nvlink"}'

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


def build_bf16_on_meta(world_size: int):
    """The same block in bf16 with its parameters and input on the meta device (nothing
    allocated): for ``--device cuda``, which plans the graphs a GPU compile would build."""
    with torch.device("meta"):
        block = Block(DIM, HEADS, FFN).to(torch.bfloat16)
    block = parallelize_module(block, init_device_mesh("cpu", (world_size,)), tp_plan())
    return block, (torch.empty(BATCH, SEQ // world_size, DIM, dtype=torch.bfloat16, device="meta"),)
