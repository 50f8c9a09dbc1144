"""The domain: blocks, formats, git store, pending diffs, recall. No Temporal import here."""
