"""The core: storage, manifest, integrity, commit, coordination, engine, retention.

Never imports lightning. Every piece receives rank, world size, process group, storage and
clock from its caller, which keeps it testable in one process.
"""
