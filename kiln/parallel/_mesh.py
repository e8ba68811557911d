"""The process grid: ``dp x tp x pp`` ranks on one ``DeviceMesh``.

A run with ``world`` processes is laid out as a grid of pipeline stages (``pp``), data-parallel
replicas (``dp``) and tensor-parallel ranks (``tp``), with the mesh dimensions in the order
``("pp", "dp", "tp")``: tensor-parallel ranks are neighbours (rank numbers differ by 1), the
place for the chattiest traffic (every block's all-reduces) on a machine's fast links; the
pipeline, which sends one activation per micro-batch, spans the farthest ranks.

HSDP (``replicate`` R > 1, under ZeRO-3) splits the data-parallel dimension into R groups of
S = dp / R neighbouring ranks: the mesh is ``("pp", "replicate", "shard", "tp")``, FSDP2 shards
over a group's S ranks (the fast links of one machine) and all-reduces gradients across the R
groups (the slow links), and ``("replicate", "shard")`` flattened is still named ``"dp"``, so
that data loading, seeds and the loss's sums see one dp dimension of R x S ranks either way
(:func:`dp_mesh`).

    >>> layout = Layout(dp=2, tp=2, pp=1)
    >>> layout.world, layout.coords(3)
    (4, {'pp': 0, 'dp': 1, 'tp': 1})
    >>> Layout(dp=4, replicate=2).shard
    2
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kiln.errors import ConfigError

__all__ = ["Layout", "resolve_layout", "check_replicate", "build_mesh", "dp_mesh", "fsdp_mesh", "MESH_DIMS",
           "HSDP_DIMS"]

MESH_DIMS = ("pp", "dp", "tp")
HSDP_DIMS = ("pp", "replicate", "shard", "tp")  # replicate > 1; "dp" is the middle two flattened


@dataclass(frozen=True)
class Layout:
    dp: int = 1
    tp: int = 1
    pp: int = 1
    replicate: int = 1  # HSDP: groups of dp / replicate ranks that FSDP2 shards over (dp's outer factor)

    @property
    def shard(self) -> int:
        """Ranks one copy of the model states is sharded over under ZeRO-3 (all dp ranks but for HSDP)."""
        return self.dp // self.replicate

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

    def as_json(self) -> dict[str, int]:
        """The sizes, as summary.json and kiln plan --json write them."""
        return {"dp": self.dp, "tp": self.tp, "pp": self.pp, "replicate": self.replicate}

    def __str__(self) -> str:
        dp = f"{self.dp} ({self.replicate} replicas x {self.shard} shards)" if self.replicate > 1 else self.dp
        return f"dp={dp} x tp={self.tp} x pp={self.pp}"


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def resolve_layout(parallel: Any, world: int) -> Layout:
    """The layout of ``world`` processes that ``parallel`` (the config's namespace) asks for.

    ``parallel.dp=None`` takes what tp and pp leave. Raises ``ConfigError`` naming the numbers
    when they do not multiply to ``world``, or when ``parallel.replicate`` does not split dp.
    """

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
    replicate = parallel.replicate
    layout = Layout(dp=dp, tp=tp, pp=pp, replicate=replicate)
    if layout.world != world:
        raise ConfigError(
            f"parallel.dp={dp} x parallel.tp={tp} x parallel.pp={pp} = {layout.world} ranks, but {world} process(es) "
            f"were started; start {layout.world} (kiln train ... --nproc {layout.world}) or set parallel.dp={world // (tp * pp)}"
        )
    check_replicate(replicate, dp)
    return layout


def check_replicate(replicate: int, dp: int) -> None:
    """Raise ``ConfigError`` unless ``parallel.replicate`` splits ``dp`` data-parallel ranks into
    groups of at least two (a group of one shards nothing: that is plain data parallel)."""

    if replicate > 1 and dp % replicate:
        raise ConfigError(f"parallel.replicate={replicate} must divide the data-parallel size parallel.dp={dp}; "
                          f"choose among {_divisors(dp)}")
    if replicate > 1 and dp == replicate:
        raise ConfigError(f"parallel.replicate={replicate} = parallel.dp leaves shard groups of one rank, which "
                          f"shard nothing; use parallel.replicate=1 (ZeRO-3 over all {dp} ranks) or parallel.zero=0 "
                          "(plain data parallel)")


def build_mesh(layout: Layout, device_type: str = "cpu") -> Any:
    """A 3-D ``DeviceMesh`` named :data:`MESH_DIMS` over all ranks (needs an initialised process
    group); take sub-meshes by name: ``mesh["tp"]``, ``mesh["pp"]``, and :func:`dp_mesh`. With
    ``layout.replicate > 1`` the mesh is 4-D (:data:`HSDP_DIMS`); :func:`fsdp_mesh` gives the
    mesh FSDP2 shards over, in either case."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.device_mesh import init_device_mesh

    with unset_fake_temporarily():  # the mesh's rank table is real even in kiln plan's fake trace
        if layout.replicate == 1:
            return init_device_mesh(device_type, layout.shape, mesh_dim_names=MESH_DIMS)
        shape = (layout.pp, layout.replicate, layout.shard, layout.tp)
        mesh = init_device_mesh(device_type, shape, mesh_dim_names=HSDP_DIMS)
        mesh["replicate", "shard"]._flatten("dp")  # its process groups made now, on every rank in the same order
        return mesh


def dp_mesh(mesh: Any, layout: Layout) -> Any:
    """The 1-D mesh of all data-parallel ranks (for HSDP, ``("replicate", "shard")`` flattened:
    dp rank = replica x S + shard, the numbering, data slice and seed a 3-D mesh's dp gives)."""
    # (torch 2.13 keeps the flattened mesh on the root, and warns that slicing it by name will go)
    return mesh["replicate", "shard"]._flatten("dp") if layout.replicate > 1 else mesh["dp"]


def fsdp_mesh(mesh: Any, layout: Layout) -> Any:
    """The mesh FSDP2 shards over: the 1-D :func:`dp_mesh` (every dp rank holds a shard), or for
    HSDP the 2-D ``mesh["replicate", "shard"]``, on which ``fully_shard`` places parameters as
    ``(Replicate(), Shard(0))`` and all-reduces the reduce-scattered gradients across replicas."""
    return mesh["replicate", "shard"] if layout.replicate > 1 else mesh["dp"]
