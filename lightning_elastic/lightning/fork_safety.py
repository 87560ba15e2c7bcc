"""Moved: the check is Lightning-free and lives in :mod:`lightning_elastic.core.forking_loaders`,
the warning class in :mod:`lightning_elastic.errors`. Kept so the old imports still work."""

from lightning_elastic.core.forking_loaders import forking_loaders, warn_forking_workers
from lightning_elastic.errors import ForkingWorkersWarning

__all__ = ["ForkingWorkersWarning", "forking_loaders", "warn_forking_workers"]
