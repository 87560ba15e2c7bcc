"""Replica groups that leave and join without stopping the others (torchft underneath): the
step protocol (:mod:`.group`), the epoch as a queue every group agrees on (:mod:`.plan`) and the
safe transfer of live state to a healing group (:mod:`.transport`). Framework-free: the
Lightning strategy (``strategy="elastic_ft"``) is a thin adapter over these."""
