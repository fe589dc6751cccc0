"""Work every process does on its first compile, done once in the rank pools' fork server.

Imported by the server (``rank_pool._context``), so that every rank forked from it starts with
these in memory instead of computing them on its first compile (about 0.6 s of CPU a rank,
measured: a forked child's first compile took 0.90 s instead of 1.54 s with ``codegen=False``).
Nothing here compiles, starts a thread or touches a process group: only pure-Python caches.
"""

from torch._inductor.codecache import torch_key
from torch._inductor.fx_passes import joint_graph, post_grad

torch_key()  # the hash of torch's own sources, part of every Inductor cache key
joint_graph.lazy_init()  # Inductor's pattern-matcher patterns, built on first use
post_grad.lazy_init()
