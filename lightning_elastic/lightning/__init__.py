"""The Lightning adapters: the only package that imports lightning."""

from lightning_elastic.lightning.callback import DistributedCheckpoint
from lightning_elastic.lightning.data import ElasticSampler
from lightning_elastic.lightning.strategy import ElasticStrategy

__all__ = ["DistributedCheckpoint", "ElasticSampler", "ElasticStrategy"]
