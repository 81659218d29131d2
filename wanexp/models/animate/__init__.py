"""Wan2.2-Animate-14B as a model family: character animation and replacement from a reference image, a pose video and
a face video, on diffusers' WanAnimateTransformer3DModel and WanAnimatePipeline (spec.py)."""
