"""Cutting a site's matmuls into pieces: shared by the patterns' ring and slicing rewrites.

The gathered / scattered tensor of a site is cut along its dim ``d`` into ``count`` equal
pieces (N chunks of m pieces each: piece ``q = j·m + s`` is piece s of rank j's chunk). These
helpers say whether a matmul can be cut so (``chunk_problem``, ``matmul_problem``), compute a
consumer matmul on some of those pieces and put the results back together.
"""

from __future__ import annotations

from math import prod

import torch.fx as fx

from commfuse_compile.piece import CONTIGUOUS

from .graph_utils import ADDMM, DTYPE_VIEW, MM, SCALED_MM, Emitter, aten, divides, fake, right_operand, same_shape, sum_in_fp32
from .site import Consumer, Site


def cut(emit: Emitter, tensor: fx.Node, dim: int, parts: int) -> list[fx.Node]:
    """``tensor`` as ``parts`` equal slices along ``dim``."""
    if parts == 1:
        return [tensor]
    size = fake(tensor).shape[dim] // parts
    return [emit(aten.slice.Tensor, tensor, dim, i * size, (i + 1) * size) for i in range(parts)]


def join(emit: Emitter, parts: list[fx.Node], dim: int) -> fx.Node:
    """``parts`` concatenated along ``dim`` (one part: itself)."""
    return parts[0] if len(parts) == 1 else emit(aten.cat.default, parts, dim)


def rows_of_pieces(emit: Emitter, matrix: fx.Node, site: Site, pieces: list[int], count: int) -> fx.Node:
    """The rows of a 2-D ``matrix`` — whose rows are the flattened leading dims of the site's
    tensor — that belong to ``pieces`` (of ``count``), in that order: row blocks on dim 0; on
    dim d > 0 slices of the un-flattened view (those rows are not contiguous), flattened again."""
    d = site.dim
    leading = list(fake(site.tensor).shape[:-1])
    width = fake(matrix).shape[1]
    if d == 0 and isinstance(fake(matrix).shape[0], int):
        size = fake(matrix).shape[0] // count
        return join(emit, [emit(aten.slice.Tensor, matrix, 0, q * size, (q + 1) * size) for q in pieces], 0)
    # (with a symbolic dim among the leading ones, rows are cut in the un-flattened view too:
    # the bounds of a row block would be symbolic)
    size = leading[d] // count
    unflat = emit(aten.reshape.default, matrix, [*leading, width])
    joined = join(emit, [emit(aten.slice.Tensor, unflat, d, q * size, (q + 1) * size) for q in pieces], d)
    return emit(aten.reshape.default, joined, [-1, width])


def piece_product(emit: Emitter, consumer: Consumer, site: Site, held: fx.Node, pieces: list[int], count: int) -> fx.Node:
    """The consumer matmul applied to ``held``, the gathered tensor's ``pieces`` in its layout.
    An addmm's bias is cut the same way (contraction partials get it once, in ``assemble``)."""
    if consumer.gathered_axis == 1:  # y += held[:, K of pieces] @ B[K of pieces, :]
        weight = right_operand(consumer.mm)
        size = fake(weight).shape[0] // count
        block = join(emit, [emit(aten.slice.Tensor, weight, 0, q * size, (q + 1) * size) for q in pieces], 0)
        return emit(MM, as_rows(emit, held, fake(held).shape[-1]), block)
    width = fake(consumer.operand_shape_of(site.tensor)).shape[-1]
    rows = as_rows(emit, held, width)  # as rows of the matmul's 2-D operand
    for view in consumer.views:  # the bytes as the matmul reads them (fp8 gathered as uint8)
        if view.target is DTYPE_VIEW:
            rows = emit(DTYPE_VIEW, rows, view.args[1])
    if consumer.role == "rows":  # y[rows of pieces] = held @ W
        bias = _bias_of_pieces(emit, consumer, site, pieces, count)
        return matmul_like(emit, consumer, rows, bias, scale_rows(emit, consumer, site, pieces, count))
    other = consumer.other_operand(site.tensor)
    transposed = emit(aten.permute.default, rows, [1, 0])
    if consumer.role == "columns":  # y[:, columns of pieces] = X @ held^T
        bias = _bias_of_pieces(emit, consumer, site, pieces, count)
        return emit(MM, other, transposed) if bias is None else emit(ADDMM, bias, other, transposed)
    if consumer.transposed:  # y += held^T @ dY[rows of pieces]
        return emit(MM, transposed, rows_of_pieces(emit, other, site, pieces, count))
    # y += A[:, columns of pieces] @ held
    columns = rows_of_pieces(emit, emit(aten.permute.default, other, [1, 0]), site, pieces, count)
    return emit(MM, emit(aten.permute.default, columns, [1, 0]), rows)


def _bias_of_pieces(emit: Emitter, consumer: Consumer, site: Site, pieces: list[int], count: int) -> fx.Node | None:
    """The part of an addmm's bias that these pieces' rows / columns of the output add: a 1-D
    bias broadcasts over rows, so rows use all of it; a full [R, M] bias is cut like the output."""
    if consumer.mm.target is not ADDMM:
        return None
    bias = consumer.mm.args[0]
    full = fake(bias).dim() == 2
    if consumer.role == "rows":
        return rows_of_pieces(emit, bias, site, pieces, count) if full else bias
    as_rows_ = emit(aten.permute.default, bias, [1, 0]) if full else emit(aten.reshape.default, bias, [-1, 1])
    columns = rows_of_pieces(emit, as_rows_, site, pieces, count)
    return emit(aten.permute.default, columns, [1, 0]) if full else emit(aten.reshape.default, columns, [-1])


def in_layout(emit: Emitter, consumer: Consumer, y: fx.Node, held: fx.Node, d: int) -> fx.Node:
    """Along dim 0 the output rows (or columns) of some pieces are a block of the output; along
    d > 0 they are not, so the result goes back to ``held``'s layout before any concatenation."""
    if d == 0 or consumer.role == "contraction":
        return y
    leading = list(fake(held).shape[:-1])
    if consumer.role == "rows":
        return emit(aten.reshape.default, y, [*leading, -1])
    return emit(aten.reshape.default, y, [fake(y).shape[0], *leading])  # columns


def output_axis(consumer: Consumer, d: int) -> int:
    """The axis of a piece's output (in layout) along which pieces are concatenated."""
    return 1 + d if consumer.role == "columns" else d


def assemble(emit: Emitter, consumer: Consumer, pieces: list[fx.Node], d: int) -> fx.Node:
    """The consumer's full result from its per-piece results: concatenated in piece order, or,
    for the contraction role, partial products summed in the order given."""
    if consumer.role == "contraction":
        bias = [consumer.mm.args[0]] if consumer.mm.target is ADDMM else []  # (the bias, once)
        return sum_in_fp32(emit, [*pieces, *bias], fake(consumer.mm).dtype)
    y = emit(aten.cat.default, pieces, output_axis(consumer, d))
    return y if d == 0 else emit(aten.reshape.default, y, list(fake(consumer.mm).shape))


def matmul_like(emit: Emitter, consumer: Consumer, rows: fx.Node, bias: fx.Node | None = None, scale: fx.Node | None = None) -> fx.Node:
    """The consumer's matmul (mm, addmm, an addmm's product alone, or ``_scaled_mm``) applied
    to other rows of its left operand; ``bias`` is the addmm's bias for those rows, ``scale``
    the ``_scaled_mm``'s ``scale_a`` for them."""
    matmul = consumer.mm
    if matmul.target is SCALED_MM:
        _, b, scale_a, *rest = matmul.args
        return emit(SCALED_MM, rows, b, scale_a if scale is None else scale, *rest, **matmul.kwargs)
    if matmul.target is ADDMM and consumer.role != "product":
        return emit(ADDMM, matmul.args[0] if bias is None else bias, rows, right_operand(matmul))
    return emit(MM, rows, right_operand(matmul))


def as_rows(emit: Emitter, chunk: fx.Node, width: int) -> fx.Node:
    """``chunk`` as rows of the matmul's 2-D operand."""
    if same_shape(fake(chunk).shape, [fake(chunk).numel() // width, width]):
        return chunk
    return emit(aten.reshape.default, chunk, [-1, width])



def accumulate(emit: Emitter, total: fx.Node | None, product: fx.Node) -> fx.Node:
    """``total + product`` for a ``product = mm(a, b)`` just emitted (and not read yet): as
    ``addmm(total, a, b)``, the sum made by the matmul itself, in its accumulator, with no
    kernel of its own (a separate add is one more kernel to compile per number of terms, and
    one more pass over the product); any other product is added. ``total`` None: the product."""
    if total is None:
        return product
    if product.target is MM and not product.users and fake(total).dtype == fake(product).dtype:
        a, b = product.args
        emit.graph.erase_node(product)
        return emit(ADDMM, total, a, b)
    return emit(aten.add.Tensor, total, product)


def piece_shape(site: Site, count: int) -> list[int]:
    """Shape of one of ``count`` pieces of the site's tensor along its dim."""
    shape = list(fake(site.tensor).shape)
    shape[site.dim] //= count
    return shape


def scale_rows(emit: Emitter, consumer: Consumer, site: Site, pieces: list[int], count: int) -> fx.Node | None:
    """A ``_scaled_mm``'s ``scale_a`` for the rows of ``pieces``: a rowwise scale ([M, 1]) is
    cut with its rows, a tensorwise one (one element) applies to every piece whole."""
    if consumer.mm.target is not SCALED_MM or fake(consumer.mm.args[2]).numel() == 1:
        return None
    rows = rows_of_pieces(emit, consumer.mm.args[2], site, pieces, count)
    # A copy made by ATen: as a view of the whole, or a copy Inductor lays out itself, the
    # size-1 dim may get another stride, which _scaled_mm refuses ("expected scale_a.stride(1)
    # to be 1"); ATen's contiguous clone of [m, 1] has strides (1, 1).
    return emit(CONTIGUOUS, rows)


def matmul_problem(matmul: fx.Node) -> str | None:
    """Why ``matmul`` (mm / addmm / _scaled_mm) cannot be computed on pieces of its rows at
    all, if so."""
    if matmul.target is SCALED_MM:
        scale, rows = fake(matmul.args[2]), fake(matmul).shape[0]
        if scale.numel() != 1 and not same_shape(scale.shape, [rows, 1]):
            return f"_scaled_mm scale_a of shape {list(scale.shape)} is neither tensorwise nor rowwise [{rows}, 1]"
    if matmul.target is ADDMM:
        if matmul.kwargs:
            return "addmm with beta/alpha"
        bias, out = list(fake(matmul.args[0]).shape), list(fake(matmul).shape)
        if not same_shape(bias, out) and len(bias) != 1:
            return f"addmm bias of shape {bias} is neither 1-D nor the output's shape {out}"
    return None


def chunk_problem(tensor: list[int], dim: int, count: int, rows_by_width: list[int] | None) -> str | None:
    """Why the 2-D matmul operand/result ``rows_by_width`` cannot be cut into the ``count``
    pieces of ``tensor`` along ``dim`` (None if it can).

    dim 0: piece q is elements [q·E, (q+1)·E) of the row-major tensor (E = numel / count), a
    block of whole rows of the 2-D view exactly when E is a multiple of the row width (and of
    the tensor's last dim, the rows a shard is cut into when dim 0 itself is too short).
    dim d > 0: pieces are not contiguous, so each is reshaped on its own; that is exact when the
    2-D view flattens every dim but the last, and d is not that last dim.
    """
    rows, width = rows_by_width
    if dim == 0:
        total = prod(tensor)
        per_piece = total // count
        if not (divides(count, total) and divides(width, per_piece) and divides(tensor[-1], per_piece)):
            return f"{tensor} does not split into {count} blocks of whole rows of [{rows}, {width}]"
        if tensor[0] % count and not isinstance(per_piece, int):
            return f"{tensor} does not split into {count} blocks along dim 0, and blocks of its rows would have a symbolic size"
        return None
    if tensor[dim] % count:
        return f"dim {dim} of {tensor} does not split into {count} pieces"
    if dim == len(tensor) - 1:
        return f"dim {dim} is the last dim of {tensor}: its pieces are columns of [{rows}, {width}], not rows"
    if not same_shape([rows, width], [prod(tensor[:-1]), tensor[-1]]):
        return f"[{rows}, {width}] is not {tensor} with its leading dims flattened"
    return None
