#!/usr/bin/env bash
# The wheels tests/gpu/setup_env.sh installs on the device machine, which reaches no package index: the packages of
# requirements.lock that its image lacks (it has torch, lightning, peft, transformers, safetensors and numpy), at the
# lock's versions, for its Python 3.12, into .whl/ (git-ignored; 42 MB). `bash tests/gpu/wheels.sh optim` makes .whl/
# hold the optimizers_5b case's packages instead (bitsandbytes, prodigyopt, came-pytorch; 43 MB): a call carries at
# most 64 MiB, so that case carries the first set in the call that builds and caches and this one in the next call on
# the same warm machine (setup_env.sh adds them to the installed site). Run from the repository root.
set -euo pipefail
if [[ "${1:-}" == optim ]]; then
  WHEELS=(bitsandbytes prodigyopt came-pytorch) SOURCES=()
else  # hydra's parser runtime is published as a source archive only: built here into a pure-Python wheel
  WHEELS=(diffusers importlib_metadata hydra-core omegaconf av ftfy wcwidth) SOURCES=(antlr4-python3-runtime)
fi
pin() { grep -i "^${1//[-_]/[-_]}==" requirements.lock || { echo "wheels.sh: $1 is not in requirements.lock" >&2; exit 2; }; }
pins=() sources=()
for n in "${WHEELS[@]}"; do pins+=("$(pin "$n")"); done
for n in "${SOURCES[@]}"; do sources+=("$(pin "$n")"); done
rm -rf .whl && mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any -d .whl "${pins[@]}"
(( ${#sources[@]} == 0 )) || python3 -m pip wheel -q --no-deps -w .whl "${sources[@]}"
du -sh .whl
