"""One load: the shard reader, checkpoint selection with verification and quarantine, and
loading (DCP, resharding N -> M)."""
