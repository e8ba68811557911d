"""The process grid: ``dp x tp x pp`` ranks on one ``DeviceMesh``.

A run with ``world`` processes is laid out as a grid of pipeline stages (``pp``), data-parallel
replicas (``dp``) and tensor-parallel ranks (``tp``), with the mesh dimensions in the order
``("pp", "dp", "tp")``: tensor-parallel ranks are neighbours (rank numbers differ by 1), the
place for the chattiest traffic (every block's all-reduces) on a machine's fast links; the
pipeline, which sends one activation per micro-batch, spans the farthest ranks.

    >>> layout = Layout(dp=2, tp=2, pp=1)
    >>> layout.world, layout.coords(3)
    (4, {'pp': 0, 'dp': 1, 'tp': 1})
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["Layout", "resolve_layout", "build_mesh", "MESH_DIMS"]

MESH_DIMS = ("pp", "dp", "tp")


@dataclass(frozen=True)
class Layout:
    dp: int = 1
    tp: int = 1
    pp: int = 1

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def shape(self) -> tuple[int, int, int]:
        """Sizes in :data:`MESH_DIMS` order."""
        return self.pp, self.dp, self.tp

    def coords(self, rank: int) -> dict[str, int]:
        """This rank's place on the grid (row-major over ``("pp", "dp", "tp")``)."""
        pp_rank, rest = divmod(rank, self.dp * self.tp)
        dp_rank, tp_rank = divmod(rest, self.tp)
        return {"pp": pp_rank, "dp": dp_rank, "tp": tp_rank}

    def __str__(self) -> str:
        return f"dp={self.dp} x tp={self.tp} x pp={self.pp}"


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def resolve_layout(parallel: Any, world: int) -> Layout:
    """The layout of ``world`` processes that ``parallel`` (the config's namespace) asks for.

    ``parallel.dp=None`` takes what tp and pp leave. Raises ``ConfigError`` naming the numbers
    when they do not multiply to ``world``.
    """
    from kiln.errors import ConfigError

    tp, pp = parallel.tp, parallel.pp
    for key, value in (("tp", tp), ("pp", pp)):
        if value < 1:
            raise ConfigError(f"parallel.{key}={value} must be at least 1")
    if world % (tp * pp):
        raise ConfigError(
            f"{world} process(es) cannot be split into parallel.tp={tp} x parallel.pp={pp} = {tp * pp} ranks per "
            f"replica; start a multiple of {tp * pp} processes (kiln train ... --nproc {tp * pp}) or choose tp x pp "
            f"among the divisors of {world} ({_divisors(world)})"
        )
    dp = parallel.dp if parallel.dp is not None else world // (tp * pp)
    layout = Layout(dp=dp, tp=tp, pp=pp)
    if layout.world != world:
        raise ConfigError(
            f"parallel.dp={dp} x parallel.tp={tp} x parallel.pp={pp} = {layout.world} ranks, but {world} process(es) "
            f"were started; start {layout.world} (kiln train ... --nproc {layout.world}) or set parallel.dp={world // (tp * pp)}"
        )
    return layout


def build_mesh(layout: Layout, device_type: str = "cpu") -> Any:
    """A 3-D ``DeviceMesh`` named :data:`MESH_DIMS` over all ranks (needs an initialised process
    group); take sub-meshes by name: ``mesh["tp"]``, ``mesh["dp"]``, ``mesh["pp"]``."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.device_mesh import init_device_mesh

    with unset_fake_temporarily():  # the mesh's rank table is real even in kiln plan's fake trace
        return init_device_mesh(device_type, layout.shape, mesh_dim_names=MESH_DIMS)
