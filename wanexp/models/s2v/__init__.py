"""Wan2.2-S2V-14B (speech-to-video): the model family's package."""
