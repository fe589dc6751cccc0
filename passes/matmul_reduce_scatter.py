"""Pattern ``matmul_reduce_scatter``: matmuls feeding a reduce-scatter, rewritten as Flash-RS.

Matches (post-grad aten graph, functional collectives; ``[ ]`` is optional)::

    sum of mm / addmm / _scaled_mm terms, joined by add and reshape
        [-> split(dim d) -> getitem × N -> cat(dim 0)]       scatter on dim d != 0 (or N slices)
        [-> permute / clone ...]                             or movedim(d, 0)[.contiguous()]
        -> reduce_scatter_tensor(·, "sum" | "avg", N, group) -> wait_tensor [and graph output]

The scattered tensor P is a sum of matmul terms (the dX of q/k/v or of w1/w3; Inductor's
``addmm(a, b, c)`` = ``a + b @ c`` is one more term plus those of ``a``). Scattered along the
last dim, each rank's chunk is a block of the products' columns, computed from column blocks of
the right operands (the left ones read whole). An fp8 ``_scaled_mm`` term takes the rows of its
rowwise ``scale_a`` with its left operand's (a tensorwise one whole). A product also read
elsewhere is left alone (the full product is needed anyway), with the reason.

The cost model times (:func:`MatmulReduceScatter.workload`): the terms' matmuls with the dims of
P (each term's own contraction dim, which only this rank knows, taken as P's width) and one
rank's output chunk in bytes: vanilla (the matmuls, then the reduce-scatter), slicing, rings.

Emits (rank r, ring schedule; :func:`commfuse_compile.schedules.flash_rs_steps`)::

    for i in 0 .. N-1:
        j = (r - 1 - i) % N
        p = mm(A_1[rows of chunk j], B_1) + ... + mm(A_t[rows of chunk j], B_t)
        if i > 0: p = p + wait_tensor(acc)     # partial sum of chunk j from ranks < r
        if i < N-1: acc = ring_exchange(p, to=r+1, from=r-1)   # overlaps the next step
    o = view(p, shape of o)                    # j = r at the last step: own chunk, no tail

With m pieces per chunk each step is m sub-steps; the bidirectional ring sends half of the
pieces the other way. The slicing baseline computes slice s and starts its reduce-scatter,
slice s's collective overlapping slice s + 1's matmuls (the last one is the tail)::

    for s in 0 .. K-1:
        o_s = reduce_scatter(mm(A[rows of pieces (0, s), ..., (N-1, s)], B))
    o = cat(wait(o_0), ..., wait(o_{K-1}))
"""

from __future__ import annotations

import itertools
from math import prod

import torch.fx as fx

from commfuse_compile.cost_model import Matmul, Workload
from commfuse_compile.schedules import flash_rs_steps, pieces_per_chunk, slice_pieces

from .chunks import accumulate, chunk_problem, cut, join, matmul_like, matmul_problem, piece_shape, scale_rows
from .fusion import Fuse
from .graph_utils import ADDMM, MATMULS, MM, REDUCE_SCATTER, RESHAPES, SCALED_MM, WAIT, Emitter, aten, bytes_of, c10d, describe_users, fake, hinted_shape, left_operand, right_operand, ring_exchange_op, same_shape, shape_of, target_name
from .layout import before_permutes, single_wait, split_cat, split_cat_source
from .pattern import Pattern
from .site import Consumer, RingStep, Site, coalesced_site


class MatmulReduceScatter(Pattern):
    name = "matmul_reduce_scatter"
    flash = "Flash-RS"
    option = "flash_rs"
    collectives = frozenset({REDUCE_SCATTER, c10d.reduce_scatter_tensor_coalesced.default})

    # ---- match ---------------------------------------------------------------------------

    def match(self, rs: fx.Node, graph_kind: str) -> Site:
        if rs.target is not REDUCE_SCATTER:
            return coalesced_site(self.name, rs, graph_kind)
        scattered, reduce_op, group_size, group_name = rs.args[:4]
        site = Site(self.name, graph_kind, rs, single_wait(rs, also_output=True), group_name, group_size)
        site.shapes["input"] = shape_of(scattered)
        if site.wait is None:
            return site.skip(f"reduce-scatter is not read through a single wait_tensor (users: {describe_users(rs)})")
        if reduce_op not in ("sum", "avg"):
            return site.skip(f"reduce op {reduce_op!r}: only 'sum' and 'avg' are decomposed")
        site.reduce_op = reduce_op
        site.tensor, site.dim, permutation, site.layout = before_permutes(scattered)
        if permutation != tuple(range(len(permutation))):
            site.permutation = permutation
        source = split_cat_source(scattered) if not site.layout else None
        if source is not None and split_cat(source[0], group_size, source[1]) == (scattered, 0):
            site.tensor, site.dim = source
        if site.tensor is not scattered:
            site.shapes["scattered"] = shape_of(site.tensor)
        path: list[fx.Node] = []
        terms = _matmul_terms(site.tensor, path)
        if terms is None:
            producer = target_name(next(n for n in path if n.target not in RESHAPES))
            return site.skip(
                f"reduce-scatter input is produced by {producer}, not a matmul or a sum of matmuls: not yet supported"
            )
        for node in path:
            # (the split/cat form's input is read by its N pieces, checked by split_cat)
            if len(node.users) > 1 and not (node is site.tensor and site.tensor is not scattered and not site.layout):
                return site.skip(
                    f"{node.name} has other users ({describe_users(node)}): the full product is "
                    "needed anyway; not yet supported"
                )
        site.consumers = terms
        if any(u.op == "output" for u in rs.users):
            site.notes.append("its result is also a graph output (saved for backward): the output is this rank's chunk, and backward's wait on it does nothing")
        for i, term in enumerate(terms):
            site.shapes[f"lhs{i}"] = shape_of(left_operand(term.mm))
            site.shapes[f"rhs{i}"] = shape_of(right_operand(term.mm))
        return site

    # ---- plan ----------------------------------------------------------------------------

    def keep_computable(self, site: Site, tensor: list[int]) -> str | None:
        for term in site.consumers:  # every term is needed: refuse the site rather than drop one
            if term.mm.target is SCALED_MM and _by_columns(site):
                return f"{term.mm.name}: a _scaled_mm scattered by output columns: not yet supported"
            problem = (matmul_problem(term.mm) if term.role != "product" else None) or self.cut_problem(site, tensor, term, site.group_size)
            if problem:
                return f"{term.mm.name}: {problem}"
        return None

    def cut_problem(self, site: Site, tensor: list[int], consumer: Consumer, count: int) -> str | None:
        product = list(fake(consumer.mm).shape)
        if not _by_columns(site):
            return chunk_problem(tensor, site.dim, count, product)
        # Scattered along the last dim: pieces are column blocks of every product.
        if tensor[-1] % count:
            return f"dim {site.dim} of {tensor} does not split into {count} pieces"
        if not same_shape(product, [prod(tensor[:-1]), tensor[-1]]):
            return f"{product} is not {tensor} with its leading dims flattened"
        return None

    def workload(self, site: Site) -> Workload:
        """The terms' matmuls ``A[rows, k] @ B[k, width]`` in dims every rank shares (a term's
        own contraction k, a row-sharded weight's height, is taken as ``width``: with uneven
        shards it differs between ranks) and the bytes of one rank's output chunk."""
        matmuls = []
        for term in site.consumers:
            rows, width = hinted_shape(term.mm)
            matmuls.append(Matmul(rows, width, width, "n" if _by_columns(site) else "m"))
        chunk = fake(site.wait)
        return Workload(self.name, site.group_size, tuple(matmuls), bytes_of(chunk), fake(site.consumers[0].mm).dtype)

    def describe(self, site: Site) -> str:
        return f", {len(site.consumers)} matmuls summed per step" if len(site.consumers) > 1 else ""

    # ---- emit ----------------------------------------------------------------------------

    def emit(self, graph: fx.Graph, site: Site, rank: int, tags: itertools.count, fuse: Fuse) -> None:
        if site.schedule == "slicing":
            _sliced(graph, site, fuse)
        else:
            _ring(graph, site, rank, tags, fuse)

    def reserved(self, site: Site) -> set[fx.Node]:
        nodes = super().reserved(site)
        stack = [site.tensor] if site.tensor is not None else []  # the reshapes and adds joining the terms
        while stack:
            node = stack.pop()
            nodes.add(node)
            if node.target in RESHAPES or node.target is aten.add.Tensor:
                stack += node.all_input_nodes
        return nodes


def _matmul_terms(node: fx.Node, path: list[fx.Node]) -> list[Consumer] | None:
    """The matmuls whose sum (through reshapes and same-shape adds) is ``node``, or None.

    Inductor folds ``a + b @ c`` into ``addmm(a, b, c)``: an addmm whose bias is a full
    [R, M] tensor is one more term (role "product": its own product, without the bias) plus
    the terms of its bias. ``path`` collects every node between the matmuls and ``node`` (to
    check they have no other users: if the full product is read elsewhere, computing it per
    chunk saves nothing).
    """
    path.append(node)
    if node.target is ADDMM and not node.kwargs and same_shape(fake(node.args[0]).shape, fake(node).shape):
        bias_terms = _matmul_terms(node.args[0], path)
        return None if bias_terms is None else [*bias_terms, Consumer(mm=node, role="product")]
    if node.target in MATMULS:
        return [Consumer(mm=node)]
    if node.target in RESHAPES:
        return _matmul_terms(node.args[0], path)
    if node.target is aten.add.Tensor and not node.kwargs and len(node.args) == 2:
        a, b = node.args
        if not all(isinstance(t, fx.Node) and same_shape(fake(t).shape, fake(node).shape) for t in (a, b)):
            return None  # broadcasting add: not a sum of same-shape products
        left, right = _matmul_terms(a, path), _matmul_terms(b, path)
        return left + right if left is not None and right is not None else None
    return None


def _ring(graph: fx.Graph, site: Site, r: int, tags: itertools.count, fuse: Fuse) -> None:
    """Flash-RS, one-way or bidirectional, as :func:`flash_rs_steps` lays it out."""
    count = site.group_size * pieces_per_chunk(site.schedule, site.chunks_per_rank)
    emit = Emitter(graph, before=site.wait)
    fused = fuse.before_scatter(site, count)
    exchange = ring_exchange_op()
    acc: dict[int, fx.Node] = {}  # stream -> the accumulator in flight to this rank
    own: dict[int, fx.Node] = {}
    for step in flash_rs_steps(site.group_size, r, site.schedule, site.chunks_per_rank):
        for sub in step:
            partial = {}
            for mv in sub:  # this step's products of the piece
                partial[mv.stream] = _summed(emit, _products(emit, site, fused, [mv.piece], count))
            for mv in sub:  # plus the partial sum of the ranks before, waited after the matmuls
                compute, p = partial[mv.stream]
                wait = emit(WAIT, acc[mv.stream]) if mv.receives else None
                if wait is not None:
                    p = emit(aten.add.Tensor, p, wait)
                site.steps.append(RingStep(chunk=mv.piece, compute=compute, start=acc.get(mv.stream), wait=wait))
                partial[mv.stream] = (compute, p)
            for mv in sub:  # on to the next rank (overlapping the next step), or this rank's own
                p = partial[mv.stream][1]
                if mv.sends:
                    acc[mv.stream] = emit(exchange, p, mv.send_to, mv.recv_from, site.group_name, next(tags))
                else:
                    own[mv.stream] = p  # the last step computes this rank's own chunk: no tail
    fused.finish(emit)
    results = [own[stream] for stream in sorted(own)]
    if site.reduce_op == "avg":  # the sum over the ranks, divided by their number
        results = [emit(aten.div.Tensor, p, site.group_size) for p in results]
    _finish(emit, site, results, count)


def _sliced(graph: fx.Graph, site: Site, fuse: Fuse) -> None:
    """The slicing baseline: K sliced reduce-scatters, each overlapping the next slice's matmuls."""
    n, k, group = site.group_size, site.chunks_per_rank, site.group_name
    count = n * k
    emit = Emitter(graph, before=site.wait)
    fused = fuse.before_scatter(site, count)
    scatters: list[fx.Node] = []
    results: list[fx.Node] = []
    for s in range(k):
        carried = slice_pieces(n, k, s)
        compute, product = _summed(emit, _products(emit, site, fused, carried, count))
        previous = scatters[-1] if scatters else None
        wait = emit(WAIT, previous) if previous is not None else None  # after this slice's matmul
        if wait is not None:
            results.append(wait)
        site.steps.append(RingStep(chunk=s, compute=compute, start=previous, wait=wait))
        scatters.append(emit(REDUCE_SCATTER, _stacked(emit, product, site, n), site.reduce_op, n, group))
    results.append(emit(WAIT, scatters[-1]))  # the tail
    fused.finish(emit)
    _finish(emit, site, results, count)


def _summed(emit: Emitter, products: list[fx.Node]) -> tuple[list[fx.Node], fx.Node]:
    """The terms' products summed (a plain matmul accumulated onto the ones before it), and
    the nodes that compute them: what a step pins between its start and its wait."""
    total, matmuls = None, []
    for product in products:
        total = accumulate(emit, total, product)
        matmuls.append(product if not product._erased else total)  # (an addmm in its place)
    return matmuls, total


def _by_columns(site: Site) -> bool:
    """Scattered along the last dim (``reduce_scatter(A @ B, scatter_dim=-1)``): each rank's
    chunk is a block of the products' columns."""
    return 0 < site.dim == fake(site.tensor).dim() - 1


def _products(emit: Emitter, site: Site, fused, pieces: list[int], count: int) -> list[fx.Node]:
    """Each term's product on ``pieces``: the rows of its left operand that belong to them (from
    the fused region where there is one), or, scattered by columns, the columns of its right
    operand (and of an addmm's bias) with the left operand read whole."""
    if not _by_columns(site):
        return [
            matmul_like(emit, term, fused.rows(emit, t, pieces), scale=scale_rows(emit, term, site, pieces, count))
            for t, term in enumerate(site.consumers)
        ]
    products = []
    for term in site.consumers:
        b = right_operand(term.mm)
        columns = _column_blocks(emit, b, 1, pieces, count)
        if term.mm.target is ADDMM and term.role != "product":
            bias = term.mm.args[0]
            products.append(emit(ADDMM, _column_blocks(emit, bias, fake(bias).dim() - 1, pieces, count), left_operand(term.mm), columns))
        else:
            products.append(emit(MM, left_operand(term.mm), columns))
    return products


def _column_blocks(emit: Emitter, tensor: fx.Node, axis: int, pieces: list[int], count: int) -> fx.Node:
    size = fake(tensor).shape[axis] // count
    return join(emit, [emit(aten.slice.Tensor, tensor, axis, q * size, (q + 1) * size) for q in pieces], axis)


def _stacked(emit: Emitter, product: fx.Node, site: Site, n: int) -> fx.Node:
    """The rows of pieces (0, s) .. (N-1, s), stacked on dim 0 as reduce_scatter cuts them."""
    if site.dim == 0:
        return product
    shape = piece_shape(site, site.chunks_per_rank)  # n pieces side by side along d
    laid_out = emit(aten.reshape.default, product, shape[:-1] + [fake(product).shape[-1]])
    return emit(aten.cat.default, cut(emit, laid_out, site.dim, n), 0)


def _finish(emit: Emitter, site: Site, own: list[fx.Node], count: int) -> None:
    """Replace the scattered result by this rank's pieces (each [rows, M], of ``count``) in order
    (along dim 0 they are blocks of rows already)."""
    if site.dim:
        own = [emit(aten.reshape.default, piece, piece_shape(site, count)) for piece in own]
    joined = join(emit, own, site.dim)
    if site.permutation:  # the collective's layout of the chunk (a movedim before it)
        joined = emit(aten.permute.default, joined, list(site.permutation))
    result = emit(aten.reshape.default, joined, list(fake(site.wait).shape))
    site.wait.replace_all_uses_with(result)
    site.collective.replace_all_uses_with(result, delete_user_cb=lambda user: user.op == "output")  # a saved result
