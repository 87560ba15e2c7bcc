"""Test helpers: multi-process spawning and fault-injecting storage (used by our own tests
and available to users who want to test their checkpointing code the same way)."""
