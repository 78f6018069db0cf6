"""The mesh a recovery or a rejoin lands on: the run's mesh spec sized to the live devices,
in a device order no rejoined process has a stale communicator for."""

from __future__ import annotations

from jaxdist.cluster import recoverable
from jaxdist.errors import EXIT_RECOVERY, JaxdistError


class RecoveryImpossible(JaxdistError):
    exit_code = EXIT_RECOVERY


def mesh_on(config, n_devices: int) -> dict[str, int]:
    """The mesh spec sized to ``n_devices`` (a ``-1`` axis takes what remains), or why not."""
    from jaxdist.layout.mesh import format_mesh, mesh_device_count, parse_mesh, resolve_mesh

    text = recoverable.MEMBERSHIP.mesh_spec or config.parallel.mesh  # the user's spec: the config holds what -1 became
    spec = parse_mesh(text)
    if spec is None:
        raise RecoveryImpossible("--mesh auto cannot be sized to the survivors: give the run a mesh such as data=-1")
    try:
        sizes = resolve_mesh(spec, n_devices)
    except JaxdistError as e:
        raise RecoveryImpossible(f"the mesh {text} does not fit the {n_devices} live devices ({e})") from None
    if mesh_device_count(sizes) != n_devices:
        raise RecoveryImpossible(f"the mesh {format_mesh(sizes)} uses {mesh_device_count(sizes)} devices, not the {n_devices} live ones")
    return sizes


def device_order(devices: list, sizes: dict[str, int], membership) -> list:
    """``devices`` in an order none of whose mesh groups a process restarted since has a stale
    communicator for (``cluster.recoverable.fresh_device_order``)."""
    from jaxdist.layout.mesh import MESH_AXES

    restarted = {d.id for d in devices if d.process_index in membership.rejoined}
    order = recoverable.fresh_device_order(devices, [sizes.get(a, 1) for a in MESH_AXES], membership.groups, restarted)
    if order is None:
        raise RecoveryImpossible(
            "no order of the live devices gives a mesh whose device groups are all new to the processes that rejoined "
            "(XLA:CPU keeps a communicator per group for a process's life): the run restarts from its last checkpoint"
        )
    return order
