"""The core: never imports lightning. Each concept lives in one folder:

* ``storage/``: the storage interface, its local and fsspec backends, retries, checksums;
* ``format/``: manifest, DCP metadata JSON, skeleton, catalog, integrity;
* ``dist/``: coordinator, commit channel, rank 0's commit;
* ``save/``: request/result types, plan, stage, write, pipeline;
* ``load/``: reader, selection (verification, quarantine), load;
* ``policy/``: retention and deletion, triggers, the save schedule, the cadence;
* ``elastic/``: data position, shard plans, RNG streams;
* ``observe/``: the health monitor, lost work, metrics, the run history;
* ``tiers/``: node-local, peer and persistent copies; ``placement/``: where checkpoints live;
* ``engine.py``: the facade (save / load / wait / close).

Every piece receives rank, world size, process group, storage and clock from its caller,
which keeps it testable in one process. See docs/architecture.md.
"""
