"""Observability: the run history, a small event log kept in the checkpoint directory
(starts, resumes, commits, failures, progress) that the run report and the cadence read.
Torch-free; recording never fails training."""
