"""Where checkpoints live, behind one interface (:class:`Placement`, see
:mod:`~lightning_elastic.core.placement.base` for which rank calls what):

* :class:`~lightning_elastic.core.placement.single.SingleRoot` - one root: saves commit and
  persist there, loads read there;
* :class:`~lightning_elastic.core.placement.tiered.Tiered` - a node-local root, replicas on
  peer nodes and the root as the persistent tier (:mod:`~lightning_elastic.core.tiers`).

The engine talks to a placement only; :func:`make_placement` is the one place that picks.
"""

from __future__ import annotations

import os

from lightning_elastic.core.dist.coordinator import Coordinator
from lightning_elastic.core.format.catalog import Catalog
from lightning_elastic.core.placement.base import Placement, save_target
from lightning_elastic.core.placement.single import SingleRoot
from lightning_elastic.core.placement.tiered import Tiered
from lightning_elastic.core.save.request import RunState, SaveConfig
from lightning_elastic.core.storage.base import Storage

__all__ = ["Placement", "SingleRoot", "Tiered", "make_placement"]


def make_placement(
    root: Storage,
    catalog: Catalog,
    coordinator: Coordinator,
    config: SaveConfig,
    run: RunState,
    *,
    local_root: str | os.PathLike[str] | None = None,
    persist_every_n_saves: int | None = None,
    replicas: int | None = None,
    local_keep: int | None = None,
    node: str | None = None,
) -> Placement:
    """Every rank, together (tiers gather the node layout and make their group): one root
    (``catalog``: its catalog), or with ``local_root`` the tiers, ``root`` the persistent one.
    The tier options are validated already (``core.options.tier_options``)."""
    if local_root is None:
        return SingleRoot(save_target(root, catalog, coordinator, config), run)
    return Tiered(
        root,
        coordinator,
        config,
        run,
        local_root=local_root,
        persist_every_n_saves=persist_every_n_saves,
        replicas=replicas,
        local_keep=local_keep,
        node=node,
    )
