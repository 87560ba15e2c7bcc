"""Observability, without Lightning: what a training loop observes (:mod:`.monitor`: step
timings, stragglers, save costs; :mod:`.lost_work`: what a restart lost and cost), the metrics
(:mod:`.health`, Prometheus-style, ``/metrics``) and the run history, a small event log kept in
the checkpoint directory (:mod:`.history`; rank 0 writes it off the training loop,
:mod:`.recorder`) that the run report and the cadence read. The metrics and the history are
torch-free (``lightning-elastic report`` reads them); recording never fails training."""
