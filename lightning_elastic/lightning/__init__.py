"""The Lightning adapters: the only package that imports lightning.

Importing it (our strategies and ``DistributedCheckpoint`` do) teaches Lightning, once per
process, to read our checkpoint directories: ``LightningModule.load_from_checkpoint``
and ``Trainer.fit/validate/test/predict(ckpt_path=DIR)`` consolidate them on the fly
(:mod:`.loading`), and ``ckpt_path="last"/"best"`` refer to a ``DistributedCheckpoint``'s
checkpoints (:mod:`.aliases`). Anything else loads as Lightning loads it. A Trainer or Fabric
given ``ElasticCheckpointIO`` under a strategy that would not call it is refused when built
(:mod:`.checkpoint_io_rules`). The strategy names
(``strategy="elastic"``, ``"elastic_fsdp"``, ``"elastic_ft"``) are registered earlier, by
``import lightning_elastic`` (:mod:`lightning_elastic._strategy_names`).

The health monitor, the save schedule and the shard plans these adapters drive live in the
core (:mod:`lightning_elastic.core.observe`, :mod:`lightning_elastic.core.policy.schedule`,
:mod:`lightning_elastic.core.elastic.shards`): this package holds hooks and wiring.
"""

from lightning_elastic.lightning.aliases import install_alias_parser
from lightning_elastic.lightning.callback import DistributedCheckpoint
from lightning_elastic.lightning.checkpoint_io import ElasticCheckpointIO
from lightning_elastic.lightning.checkpoint_io_rules import install_strategy_check
from lightning_elastic.lightning.data import ElasticSampler
from lightning_elastic.lightning.fsdp import ElasticFSDPStrategy
from lightning_elastic.lightning.loading import install_checkpoint_loader
from lightning_elastic.lightning.replicas import ElasticFTStrategy
from lightning_elastic.lightning.strategy import ElasticStrategy

install_checkpoint_loader()
install_alias_parser()
install_strategy_check()

__all__ = [
    "DistributedCheckpoint",
    "ElasticCheckpointIO",
    "ElasticFSDPStrategy",
    "ElasticFTStrategy",
    "ElasticSampler",
    "ElasticStrategy",
]
