"""Scheduling: the rows' host state (`slots`: every row's state, aligned with its slot; `batch`: the active rows,
their records and the target's inputs) and the round loop (`rounds`: admission, then plan -> propose -> verify ->
finish, one read-back per round; `stops`: stop strings)."""
