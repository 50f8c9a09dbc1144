"""Where memory is kept: the git repository of blocks and the SQL database (pending diffs,
recall, turn bookkeeping, summaries)."""
