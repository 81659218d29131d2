#!/usr/bin/env bash
# FlashAttention-4 for the device machine, which reaches no package index (python -m tests.gpu.run attention_fa4):
# its wheels into .fa4a/ and .fa4b/ (git-ignored), each within one call's carry. The CuTe DSL's CUDA 13 library (a
# 92 MB wheel, 227 MB unpacked) travels as an xz tar in two parts: the first with the small wheels in .fa4a/ (carried
# with .whl/ in the call that builds the DiT), the rest in .fa4b/ (carried alone in the next call on the same warm
# machine); tests/gpu/setup_fa4.sh stages and installs them there. Run from the repository root; ~4 min on 2 cores.
set -euo pipefail
W=$(mktemp -d)
trap 'rm -rf "$W"' EXIT
pip download -q -d "$W" --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 \
  --platform manylinux_2_24_x86_64 --platform any flash-attn-4==4.0.0b36 nvidia-cutlass-dsl==4.8.1 \
  nvidia-cutlass-dsl-libs-base==4.8.1 nvidia-cutlass-dsl-libs-core==4.8.1 nvidia-cutlass-dsl-libs-cu13==4.8.1 \
  apache-tvm-ffi==0.1.15.post2 quack-kernels==0.6.5 torch-c-dlpack-ext==0.1.5 einops==0.8.1
mkdir -p "$W/cu13" && python3 -m zipfile -e "$W"/nvidia_cutlass_dsl_libs_cu13-*.whl "$W/cu13"
rm "$W"/nvidia_cutlass_dsl_libs_cu13-*.whl
tar cf - -C "$W/cu13" . | xz -9e -T0 > "$W/cu13.tar.xz"
rm -rf .fa4a .fa4b && mkdir -p .fa4a .fa4b
head -c 7000000 "$W/cu13.tar.xz" > .fa4a/cu13.part_a
tail -c +7000001 "$W/cu13.tar.xz" > .fa4b/cu13.part_b
mv "$W"/*.whl .fa4a/
du -sh .fa4a .fa4b
