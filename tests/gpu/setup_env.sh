# Sourced by the device-machine scripts (and run once by `python -m tests.gpu.run`): install the carried wheels
# (.whl/), set paths, record the card and versions.
set -euo pipefail
OUT=${OUT:-/tmp/wanexp_out}
mkdir -p "$OUT"
SITE=${WANEXP_SITE:-/tmp/site}
# once per machine (a later call on the same warm machine finds the same wheels installed)
if ! ls .whl | cmp -s - "$SITE/.wanexp_wheels" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl
  mkdir -p "$SITE" && ls .whl > "$SITE/.wanexp_wheels"
fi
export PYTHONPATH=$SITE:$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
W=${WANEXP_GPU_WORK:-/tmp/wanexp_gpu}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, diffusers, lightning, peft, transformers, hydra, av; print('torch', torch.__version__, 'diffusers', diffusers.__version__, 'lightning', lightning.__version__, 'peft', peft.__version__, 'transformers', transformers.__version__, 'hydra', hydra.__version__, 'av', av.__version__)" | tee -a "$OUT/gpu.txt"
# time since this script started; what is left before DEADLINE s (one device call's budget: a per-item timeout)
T0=$(date +%s)
DEADLINE=${DEADLINE:-570}
say() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
left() { local s=$(( DEADLINE - ($(date +%s) - T0) )); echo $(( s > 1 ? s : 1 )); }
# fail NAME: count a failed item; a script that uses it ends with `exit $FAILED` (the registry's pass/fail)
FAILED=0
fail() { echo "FAILED: $*"; FAILED=$((FAILED + 1)); }
# prepare_5b [NUM_CLIPS]: the real-size TI2V-5B (random weights, light encoders) in $M5 and NUM_CLIPS (default 48)
# generated 704x1280x17 clips cached; D5 holds the model/data overrides of a run from that cache (EXTRA5 adds some)
prepare_5b() {
  M5="$W/ti2v5b_light"
  python3 tests/gpu/build_random_model.py --model ti2v5b --entry ti2v5b_light --path "$M5" 2>&1 \
    | grep -v "should be kept" | tail -1
  D5=(model=ti2v5b model.path="$M5" data=synthetic paths.data_dir="$W/data5" data.height=704 data.width=1280
      data.num_frames=17 data.batch_size=1 data.num_workers=4 data.generate.height=704 data.generate.width=1280
      data.generate.num_frames=17 data.generate.num_videos=${1:-48} data.generate.num_images=0
      paths.cache_dir="$W/cache" trainer.precision=bf16-mixed ${EXTRA5:-})
  python3 -m wanexp.cli.cache "${D5[@]}" paths.output_dir="$W/cache_run5" > "$OUT/cache5.log" 2>&1 \
    || tail -20 "$OUT/cache5.log"
  say "cache: $(grep 'wanexp: cache' "$OUT/cache5.log" | tail -1)"
}
