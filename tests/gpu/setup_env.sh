# Sourced by the device-machine scripts: install the carried wheels (.whl/), set paths, record the card and versions.
set -euo pipefail
OUT=${OUT:-/tmp/wanexp_out}
mkdir -p "$OUT"
# once per machine (a later call on the same warm machine finds the same wheels installed)
if ! ls .whl | cmp -s - /tmp/site/.wanexp_wheels 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  mkdir -p /tmp/site && ls .whl > /tmp/site/.wanexp_wheels
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
W=${WANEXP_GPU_WORK:-/tmp/wanexp_gpu}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, diffusers, lightning, peft, transformers, hydra, av; print('torch', torch.__version__, 'diffusers', diffusers.__version__, 'lightning', lightning.__version__, 'peft', peft.__version__, 'transformers', transformers.__version__, 'hydra', hydra.__version__, 'av', av.__version__)" | tee -a "$OUT/gpu.txt"
# time since this script started; what is left before DEADLINE s (one device call's budget: a per-item timeout)
T0=$(date +%s)
DEADLINE=${DEADLINE:-570}
say() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
left() { local s=$(( DEADLINE - ($(date +%s) - T0) )); echo $(( s > 1 ? s : 1 )); }
