"""Rotation of overflowing blocks into the archive: the strategies (strategies.py), the planner
that checks blocks and plans a rotation (planner.py), the steps that carry it out (steps.py);
and finished tasks into the archive (task_sink.py). The adaptive strategy's saved state is a
table of the SQL store (store/rotation_state.py)."""
