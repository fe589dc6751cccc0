"""Cutting a site's matmuls into pieces: shared by the ring and slicing rewrites.

The gathered / scattered tensor of a site is cut along its dim ``d`` into ``count`` equal
pieces (N chunks of m pieces each: piece ``q = j·m + s`` is piece s of rank j's chunk). These
helpers compute a consumer matmul on some of those pieces and put the results back together.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from .graph_utils import ADDMM, MM, Emitter, aten, fake, right_operand
from .site import Consumer, Site


def cut(emit: Emitter, tensor: fx.Node, dim: int, parts: int) -> list[fx.Node]:
    """``tensor`` as ``parts`` equal slices along ``dim``."""
    if parts == 1:
        return [tensor]
    size = fake(tensor).shape[dim] // parts
    return [emit(aten.slice.Tensor, tensor, dim, i * size, (i + 1) * size) for i in range(parts)]


def shard_pieces(emit: Emitter, site: Site, parts: int) -> list[fx.Node]:
    """This rank's shard of a Flash-AG site cut into ``parts`` pieces along the site's dim.
    Along dim 0 a piece is a block of whole rows; where dim 0 has too few entries (a batch-1
    sequence gather, [1, S/N, H]) the shard is cut as rows of [-1, H] instead."""
    shard = site.collective.args[0]
    if site.dim == 0 and fake(shard).shape[0] % parts:
        shard = emit(aten.reshape.default, shard, [-1, fake(site.tensor).shape[-1]])
    return cut(emit, shard, site.dim, parts)


def join(emit: Emitter, parts: list[fx.Node], dim: int) -> fx.Node:
    """``parts`` concatenated along ``dim`` (one part: itself)."""
    return parts[0] if len(parts) == 1 else emit(aten.cat.default, parts, dim)


def emitter_before_consumers(graph: fx.Graph, site: Site) -> Emitter:
    """An emitter placing nodes before the first consumer matmul of a Flash-AG site."""
    order = {node: i for i, node in enumerate(graph.nodes)}
    return Emitter(graph, before=min((c.mm for c in site.consumers), key=order.__getitem__))


def rows_of_pieces(emit: Emitter, matrix: fx.Node, site: Site, pieces: list[int], count: int) -> fx.Node:
    """The rows of a 2-D ``matrix`` — whose rows are the flattened leading dims of the site's
    tensor — that belong to ``pieces`` (of ``count``), in that order: row blocks on dim 0; on
    dim d > 0 slices of the un-flattened view (those rows are not contiguous), flattened again."""
    d = site.dim
    leading = list(fake(site.tensor).shape[:-1])
    width = fake(matrix).shape[1]
    if d == 0:
        size = fake(matrix).shape[0] // count
        return join(emit, [emit(aten.slice.Tensor, matrix, 0, q * size, (q + 1) * size) for q in pieces], 0)
    size = leading[d] // count
    unflat = emit(aten.reshape.default, matrix, [*leading, width])
    joined = join(emit, [emit(aten.slice.Tensor, unflat, d, q * size, (q + 1) * size) for q in pieces], d)
    return emit(aten.reshape.default, joined, [-1, width])


def piece_product(emit: Emitter, consumer: Consumer, site: Site, held: fx.Node, pieces: list[int], count: int) -> fx.Node:
    """The consumer matmul applied to ``held``, the gathered tensor's ``pieces`` in its layout.
    An addmm's bias is cut the same way (contraction partials get it once, in ``assemble``)."""
    width = fake(consumer.view or site.tensor).shape[-1]
    rows = as_rows(emit, held, width)  # as rows of the matmul's 2-D operand
    if consumer.role == "rows":  # y[rows of pieces] = held @ W
        return matmul_like(emit, consumer, rows, _bias_of_pieces(emit, consumer, site, pieces, count))
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
        # One matmul would accumulate the whole contraction in fp32 and round once; summing
        # rounded low-precision partials would lose that, so sum them in fp32.
        dtype = fake(consumer.mm).dtype
        wide = dtype in (torch.bfloat16, torch.float16)
        to = torch.ops.prims.convert_element_type.default
        parts = [emit(to, p, torch.float32) if wide else p for p in pieces]
        if consumer.mm.target is ADDMM:  # the bias, once
            bias = consumer.mm.args[0]
            parts.append(emit(to, bias, torch.float32) if wide else bias)
        total = sum_nodes(emit, parts)
        return emit(to, total, dtype) if wide else total
    y = emit(aten.cat.default, pieces, output_axis(consumer, d))
    return y if d == 0 else emit(aten.reshape.default, y, list(fake(consumer.mm).shape))


def matmul_like(emit: Emitter, consumer: Consumer, rows: fx.Node, bias: fx.Node | None = None) -> fx.Node:
    """The consumer's matmul (mm, addmm, or an addmm's product alone) applied to other rows
    of its left operand; ``bias`` is the addmm's bias for those rows."""
    matmul = consumer.mm
    if matmul.target is ADDMM and consumer.role != "product":
        return emit(ADDMM, matmul.args[0] if bias is None else bias, rows, right_operand(matmul))
    return emit(MM, rows, right_operand(matmul))


def as_rows(emit: Emitter, chunk: fx.Node, width: int) -> fx.Node:
    """``chunk`` as rows of the matmul's 2-D operand."""
    shape = list(fake(chunk).shape)
    if shape == [fake(chunk).numel() // width, width]:
        return chunk
    return emit(aten.reshape.default, chunk, [-1, width])


def sum_nodes(emit: Emitter, nodes: list[fx.Node]) -> fx.Node:
    """``nodes[0] + nodes[1] + ...``, added in that order."""
    total = nodes[0]
    for node in nodes[1:]:
        total = emit(aten.add.Tensor, total, node)
    return total


def piece_shape(site: Site, count: int) -> list[int]:
    """Shape of one of ``count`` pieces of the site's tensor along its dim."""
    shape = list(fake(site.tensor).shape)
    shape[site.dim] //= count
    return shape


def whole_tensor_readers(site: Site) -> list[str]:
    """Nodes that still read the whole gathered tensor (directly or through a consumer's
    reshape or transpose) once the consumer matmuls are rewritten, e.g. a save for backward."""
    chain = {v for c in site.consumers for v in (*c.views, *c.permutes)}
    covered = chain | {c.mm for c in site.consumers}
    names = []
    for node in [site.tensor, *chain]:
        via = "" if node is site.tensor else f" (via {node.name})"
        names += [f"{u.name}{via}" for u in node.users if u not in covered]
    return names


def finish_all_gather(
    emit: Emitter, site: Site, outputs: list[list[fx.Node]], partials: list[list[fx.Node]], held: list[fx.Node]
) -> None:
    """Assemble each consumer's result (``outputs``: its pieces in tensor order; ``partials``:
    a contraction consumer's partial products) and replace the consumer by it; serve any other
    reader of the gathered tensor from the pieces ``held`` (never by a second collective)."""
    readers = whole_tensor_readers(site)
    for c, consumer in enumerate(site.consumers):
        pieces = partials[c] if consumer.role == "contraction" else outputs[c]
        consumer.mm.replace_all_uses_with(assemble(emit, consumer, pieces, site.dim))
    if readers:
        whole = emit(aten.cat.default, held, site.dim)
        if fake(whole).shape != fake(site.tensor).shape:  # pieces cut as rows (shard_pieces)
            whole = emit(aten.reshape.default, whole, list(fake(site.tensor).shape))
        site.tensor.replace_all_uses_with(whole)
        site.notes.append(f"gathered tensor rebuilt from the pieces for {', '.join(readers)}")


def finish_reduce_scatter(emit: Emitter, site: Site, own: list[fx.Node], count: int) -> None:
    """Replace the scattered result by this rank's pieces (each [rows, M], of ``count``) in order
    (along dim 0 they are blocks of rows already)."""
    if site.dim:
        own = [emit(aten.reshape.default, piece, piece_shape(site, count)) for piece in own]
    joined = join(emit, own, site.dim)
    site.wait.replace_all_uses_with(emit(aten.reshape.default, joined, list(fake(site.wait).shape)))
