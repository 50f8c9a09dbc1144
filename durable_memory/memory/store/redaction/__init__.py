"""Redacting a text (`dmem redact`): the rewrite of a block's git history (history.py) and the
redaction of a user's SQL rows (rows.py)."""
