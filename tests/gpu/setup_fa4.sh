# FlashAttention-4 on the device machine, from the parts tests/gpu/fa4_parts.sh made. Source it (do not pipe it) after
# tests/gpu/setup_env.sh in each call: it stages what the call carries (.fa4a/, .fa4b/) in /tmp/fa4stage, which the
# machine keeps while it stays warm; once both parts are there it installs them into /tmp/fa4site (once) and puts
# that on PYTHONPATH (the wheels' .pth file is not read from there: its dsl_packages folder is added by hand).
STAGE=/tmp/fa4stage
FA=${WANEXP_FA4_SITE:-/tmp/fa4site}  # tests/gpu/run.py puts it on its phases' PYTHONPATH once installed
mkdir -p "$STAGE"
for d in .fa4a .fa4b; do
  if [ -d "$d" ]; then cp -n "$d"/* "$STAGE"/; fi
done
if [ ! -f "$FA/.done" ] && [ -f "$STAGE/cu13.part_a" ] && [ -f "$STAGE/cu13.part_b" ]; then
  rm -rf "$FA" && mkdir -p "$FA"
  cat "$STAGE/cu13.part_a" "$STAGE/cu13.part_b" | xz -d | tar xf - -C "$FA"
  for w in "$STAGE"/*.whl; do python3 -m zipfile -e "$w" "$FA"; done
  touch "$FA/.done"
fi
if [ -f "$FA/.done" ]; then
  export PYTHONPATH="$FA/nvidia_cutlass_dsl/dsl_packages:$FA:${PYTHONPATH:-}"
  echo "FlashAttention-4 from $FA"
else
  echo "FlashAttention-4 not installed yet: $(ls "$STAGE" | wc -l) files staged; carry the other part next"
fi
