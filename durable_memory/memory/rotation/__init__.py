"""Rotation of overflowing blocks into the archive: strategies, the rotator, the adaptive state."""
