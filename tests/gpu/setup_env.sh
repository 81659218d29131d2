# Run once per machine by `python -m tests.gpu.run` (the registry's cases): install the carried wheels (.whl/)
# into $WANEXP_SITE and record the card and versions in $OUT/gpu.txt.
set -euo pipefail
OUT=${OUT:-/tmp/wanexp_out}
mkdir -p "$OUT"
SITE=${WANEXP_SITE:-/tmp/site}
# once per machine (a later call on the same warm machine finds the same wheels installed)
if ! ls .whl | cmp -s - "$SITE/.wanexp_wheels" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl
  mkdir -p "$SITE" && ls .whl > "$SITE/.wanexp_wheels"
fi
export PYTHONPATH=$SITE:$PWD
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, diffusers, lightning, peft, transformers, hydra, av; print('torch', torch.__version__, 'diffusers', diffusers.__version__, 'lightning', lightning.__version__, 'peft', peft.__version__, 'transformers', transformers.__version__, 'hydra', hydra.__version__, 'av', av.__version__)" | tee -a "$OUT/gpu.txt"
