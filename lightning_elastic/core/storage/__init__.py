"""Storage: a small abstract interface (``Storage``) with a local-disk and an fsspec backend,
retries of transient errors, and the checksums computed while writing."""
