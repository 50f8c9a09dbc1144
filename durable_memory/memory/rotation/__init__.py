"""Rotation of overflowing blocks into the archive: the strategies (strategies.py), the planner
that checks blocks and plans a rotation (planner.py), the steps that carry it out (steps.py),
the adaptive strategy's saved state (state.py); and finished tasks into the archive
(task_sink.py)."""
