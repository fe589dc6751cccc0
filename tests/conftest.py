import contextlib
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # rank_pool and the test modules, also in spawned ranks

# Inductor checks that the C++ compiler builds its vector ISA (AVX2 here) by compiling and
# loading a probe once per cache directory: 3-4 s of g++ for each of the suite's dozen or so
# caches (rank pools, benchmark runs). Trust the CPU's flags instead: on this machine both
# pick AVX2, and a compiler that could not build it fails every kernel loudly, not silently.
# (Before torch is imported anywhere: Inductor's config reads it at import.)
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "1")

from rank_pool import RankPool  # noqa: E402


@pytest.fixture(scope="session")
def inductor_cache_dir(tmp_path_factory) -> str:
    """A private Inductor cache for this test session (a warm cache from elsewhere could hide bugs)."""
    path = str(tmp_path_factory.mktemp("inductor_cache"))
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = path
    return path


@pytest.fixture(scope="module", params=[2, 4], ids=lambda ws: f"ws{ws}")
def ranks(request, inductor_cache_dir) -> RankPool:
    """Gloo ranks spawned once per module and world size."""
    pool = RankPool(request.param, os.path.join(inductor_cache_dir, f"{request.module.__name__}_ws{request.param}"))
    yield pool
    pool.close()


@pytest.fixture(autouse=True, scope="session")
def _private_inductor_cache(inductor_cache_dir):
    """Every test session compiles into its own Inductor cache."""
    yield


@contextlib.contextmanager
def fake_world(world_size: int, rank: int = 0):
    """A single-process fake process group: traces and compiles at any world size, no traffic."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()
