"""Kernels of a rewritten graph: generated once per piece shape, not once per ring step.

A Llama-style TP + SP block (forward + backward) is compiled under the fake process group and
the C++ kernels Inductor's generated code defines are counted by their sources (what its
compiler would compile). The compiler itself is stubbed out (each kernel a no-op): only the
sources are needed, and the outputs of a fake process group are garbage anyway. Every ring step
reads its pieces through pointers of their own (``commfuse.piece``), so the distinct kernels do
not grow with the group: a kernel per step, each with its piece's offset baked in, would add
N − 1 of them per fused op (39 at 4 ranks, before).

The same generated code shows what the ring sends: every transfer sends a buffer as it is (no
copy made for it) and its wait reads that buffer, so Inductor keeps it, unmodified, until then.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator

import pytest
import torch
from torch._inductor.async_compile import AsyncCompile
from torch._inductor.utils import run_and_get_code

import commfuse_compile
from commfuse_compile.models import Block, tp_plan
from conftest import fake_world

DIM, HEADS, FFN, BATCH, SEQ_PER_RANK = 64, 8, 128, 2, 4


@contextlib.contextmanager
def kernel_sources() -> Iterator[list[str]]:
    """Every C++ kernel source the generated code defines while inside, none compiled."""
    sources: list[str] = []
    original = AsyncCompile.cpp_pybinding

    def recorded(self, argtypes, source):
        sources.append(source)
        return lambda *args: None

    AsyncCompile.cpp_pybinding = recorded
    try:
        with torch._inductor.config.patch(fx_graph_cache=False), torch._functorch.config.patch(enable_autograd_cache=False):
            yield sources
    finally:
        AsyncCompile.cpp_pybinding = original


def distinct_kernels(world: int, backend: str = "commfuse", **options) -> int:
    """Distinct kernel sources of one block's forward + backward at ``world`` ranks."""
    return len(set(compile_block(world, backend, **options)[0]))


def compile_block(world: int, backend: str = "commfuse", **options) -> tuple[list[str], list[str]]:
    """The kernel sources and the generated code of one block's forward + backward."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    with fake_world(world):
        torch._dynamo.reset()
        commfuse_compile.clear_reports()
        torch.manual_seed(0)
        block = parallelize_module(torch.nn.Sequential(Block(DIM, HEADS, FFN)), init_device_mesh("cpu", (world,)), tp_plan("0."))
        kwargs = {} if backend == "inductor" else {"options": {"schedule": "ring", **options}}
        model = torch.compile(block, backend=backend, **kwargs)
        x = torch.randn(BATCH, SEQ_PER_RANK, DIM, requires_grad=True)
        with kernel_sources() as sources:
            _, code = run_and_get_code(lambda: model(x).sum().backward())
        if backend == "commfuse":  # (2 AG + 2 RS, forward and backward)
            assert sum(s.rewritten for r in commfuse_compile.reports() for s in r.sites) == 8
        torch._dynamo.reset()
    return sources, code


@pytest.fixture(scope="module")
def ring_block() -> tuple[list[str], list[str]]:
    return compile_block(4)


@pytest.fixture(scope="module")
def ring_kernels(ring_block) -> int:
    return len(set(ring_block[0]))


def test_kernels_do_not_grow_with_the_group(ring_kernels):
    """8 ranks: one more step per ring of each, smaller pieces, the same kernels as 4; and
    within 1.3x of what Inductor alone generates for the block."""
    assert distinct_kernels(8) == ring_kernels
    assert ring_kernels <= 1.3 * distinct_kernels(4, backend="inductor")


def test_finer_pieces_add_no_kernel_per_piece(ring_kernels):
    """chunks_per_rank=2 cuts each chunk in two: twice the steps (24 transfers more), their
    kernels shared. A few are new: the pieces have a new shape, and causal attention's query
    pieces each see a different number of keys, so their kernels differ."""
    assert distinct_kernels(4, chunks_per_rank=2) <= ring_kernels + 3


_BUF = r"(buf\d+|primals_\d+|tangents_\d+|arg\d+_\d+)"
_SEND = re.compile(rf"^\s*(buf\d+) = torch\.ops\.commfuse\.ring_exchange\.default\({_BUF},")
_HELD = re.compile(rf"torch\.ops\.commfuse\.wait_exchange\.default\((buf\d+), {_BUF}\)")
_ALIAS = re.compile(r"^\s*(buf\d+) = (buf\d+)\s*$")


def sends(code: str) -> list[tuple[str, list[str]]]:
    """For every ring transfer in ``code``: the buffer it sends, and the lines from its start
    to its wait (asserting that the wait reads the same buffer). Buffers are followed through
    Inductor's ``bufB = bufA`` aliases of an extern call's result."""
    lines, found = code.splitlines(), []
    for i, line in enumerate(lines):
        if m := _SEND.match(line):
            names, sent = {m.group(1)}, m.group(2)
            for j in range(i + 1, len(lines)):
                if (alias := _ALIAS.match(lines[j])) and alias.group(2) in names:
                    names.add(alias.group(1))
                elif (held := _HELD.search(lines[j])) and held.group(1) in names:
                    assert held.group(2) == sent, (line, lines[j])
                    found.append((sent, lines[i : j + 1]))
                    break
            else:
                raise AssertionError(f"no wait_exchange reads the transfer of {line.strip()}")
    return found


def test_every_send_is_read_in_place_until_its_wait(ring_block):
    """The block at 4 ranks: 3 transfers per ring, 8 rings. Each sends its buffer without a
    copy made for it, and between the start and its wait no line frees the buffer, reuses it
    for another result or writes into it."""
    _, code = ring_block
    found = [send for graph in code for send in sends(graph)]
    assert len(found) == 8 * 3, len(found)
    for sent, lines in found:
        assert not any(re.search(rf"\b(del {sent}\b|\w+ = {sent}\b|{sent} = )", line) for line in lines[1:-1]), (sent, lines)
        assert not any(f"out={sent}" in line or f"({sent}.data_ptr()" in line for line in lines[1:-1]), (sent, lines)
    producers = [re.search(rf"^\s*{sent} = (.*)$", graph, re.M) for graph in code for sent, _ in sends(graph)]
    copies = [m.group(1) for m in producers if m and re.search(r"contiguous|clone", m.group(1))]
    assert not copies, copies
