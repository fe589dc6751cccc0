"""``torch.ops.commfuse.piece``: a slice that Inductor's kernels read through a pointer of its own.

``piece(x, dim, start, end)`` is ``x.narrow(dim, start, end - start)``: a view, no copy. What
differs from ``aten.slice`` is how Inductor compiles a kernel that reads it. A slice is lowered
into the kernel's index expressions, with its offset as a constant (``in_ptr0 + 256L + ...``),
so the kernels of two ring steps that compute the same ops on different pieces are different
sources, each compiled again: one per step, growing with the group size. ``piece`` has no
lowering: Inductor calls it (an extern call of a few microseconds) and passes its result to the
kernels as a tensor of its own, so every piece of one shape and strides is read by the same
compiled kernel. Its schema says the result aliases ``x``, which keeps Inductor from freeing or
reusing ``x``'s memory while a piece of it is still read.

``contiguous(x)`` is ``x.clone(memory_format=torch.contiguous_format)``, made by ATen: where
a piece must be copied before a matmul can read it (a block of rows of ``[B, S, H]`` cut along
``S`` is not a matrix), the copy costs no generated kernel to compile.

Only the pass emits them, into post-grad graphs (after functionalization, which refuses custom
views).
"""

from __future__ import annotations

import torch

__all__ = ["CONTIGUOUS", "PIECE"]

_lib = torch.library.Library("commfuse", "FRAGMENT")
_lib.define("piece(Tensor(a) self, int dim, SymInt start, SymInt end) -> Tensor(a)")


def _narrow(x: torch.Tensor, dim: int, start: int, end: int) -> torch.Tensor:
    return x.narrow(dim, start, end - start)


_lib.impl("piece", _narrow, "CompositeExplicitAutograd")
_lib.impl("piece", _narrow, "Meta")
_lib.define("contiguous(Tensor self) -> Tensor")


def _copy(x: torch.Tensor) -> torch.Tensor:
    return x.clone(memory_format=torch.contiguous_format)


_lib.impl("contiguous", _copy, "CompositeExplicitAutograd")
_lib.impl("contiguous", _copy, "Meta")

PIECE = torch.ops.commfuse.piece.default
CONTIGUOUS = torch.ops.commfuse.contiguous.default
