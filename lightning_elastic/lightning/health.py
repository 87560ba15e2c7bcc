"""Where ``DistributedCheckpoint``'s hooks feed the health monitor.

The monitor itself (step timings, stragglers, each save's cost, lost work and recovery, the
metrics, the history records and their background writer) needs no Lightning and lives in
:mod:`lightning_elastic.core.observe` (:class:`~lightning_elastic.HealthMonitor`), so a loop
around :class:`~lightning_elastic.CheckpointEngine` uses it too. The callback calls it from
these hooks, every rank, in this order:

==============================  ===========================================================
``setup("fit")``                ``HealthMonitor(...)``, ``start(coordinator, port=, ...)``
``on_train_start``              ``train_start(history, coordinator, resumed=Resumed.of(
                                session.resumed, session.resume_cost), ...)``
``on_train_batch_start``        ``batch_start()``; a deferred save inside ``saving()``
``on_before_backward``          ``before_backward()``
``on_before_optimizer_step``    ``before_optimizer_step()``
``on_train_batch_end``          ``step_end``, ``replica_events``, the agreement with
                                ``shared``/``after_agreement(step, shared,
                                trainer.loggers)``, ``first_step``, ``step_recorded``,
                                ``step_done``
``on_validation_start/_end``    ``validation_started()`` / ``validation_ended()``
a save                          ``in_flight``, ``skipped``, ``committed``, ``failed``,
                                ``log_to(trainer.loggers, step)``
``on_train_end``, a signal,     ``train_end(step, reason=...)``, or ``crashed(step)``;
an exception; ``teardown``      ``close()``
==============================  ===========================================================

The names below are re-exported from their new homes for the imports that used this module.
"""

from lightning_elastic.core.observe.lost_work import Resumed, process_start_unix
from lightning_elastic.core.observe.monitor import HealthMonitor, failure_phase
from lightning_elastic.core.tiers.layout import node_name

__all__ = ["HealthMonitor", "Resumed", "failure_phase", "node_name", "process_start_unix"]
