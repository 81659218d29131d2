"""Wan2.2: the TI2V-5B and A14B layouts (specs, original-release conversion, fast forward, tiny builds)."""
