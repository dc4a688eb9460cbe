"""staging: host staging buffers and refills of a saved state (pool, copy plan, overlapped copies)."""
