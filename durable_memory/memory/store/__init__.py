"""Where memory is kept: the users' git repositories of blocks (git/), which the domain sees as
a `BlockRepository` (block_repository.py), and the SQL database (sql.py, db.py): pending diffs,
recall, turn bookkeeping, summaries, the adaptive rotation state."""
