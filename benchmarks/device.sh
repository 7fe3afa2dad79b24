#!/usr/bin/env bash
# The benchmark on a machine with one accelerator (GPU or TPU): a ~19 GB LLaMA-like
# state with Adam moments, built on the device, saved and restored by orbax_flax,
# orbax-checkpoint and torch DCP (CUDA tensors on a GPU; CPU tensors on a TPU, which
# torch cannot use), against the host's limits; prints the same tables as on CPU:
#
#   bash benchmarks/device.sh              # SIZE=2gb for a quick smoke test
#
# On a one-chip TPU v5e (15.7 GiB) use SIZE=2gb (the 20 GB state does not fit) and
# REPS=1 if one command may run only 10 minutes: REPS=3 took longer there, REPS=1 took
# 5 minutes (2026-12-05 and 2026-12-06; the table is in benchmarks/README.md).
#
# It installs only what the machine lacks: the library's dependencies and what the
# benchmark imports (the peers orbax-checkpoint and torch, and safetensors). With no
# network, either put every wheel in .whl/ (installed from there with --no-deps), or
# install first from the machine's own index as on the TPU of 2026-12-06
# (benchmarks/README.md, "TPU v5e, one chip") and put its folder on PYTHONPATH.
# Results go to $OUT (or /tmp): device-SIZE.json.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
SIZE=${SIZE:-20gb}
OUTDIR=${OUT:-/tmp}
missing=()
for mod in google_crc32c xxhash ml_collections clu tensorstore flax optax orbax.checkpoint torch safetensors; do
  "$PY" -c "import $mod" 2>/dev/null || missing+=("$mod")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "installing: ${missing[*]}"
  if [ -d .whl ]; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/ofx-site .whl/*.whl
    export PYTHONPATH=/tmp/ofx-site:${PYTHONPATH:-}
  else
    packages=()
    for mod in "${missing[@]}"; do  # the pip name of each module: google_crc32c -> google-crc32c
      name=${mod//_/-}
      packages+=("${name//./-}")
    done
    "$PY" -m pip install -q "${packages[@]}"
  fi
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-}
export XLA_PYTHON_CLIENT_PREALLOCATE=false  # jax and torch share the device
unset XLA_FLAGS
"$PY" -c "import jax; print('devices:', jax.devices())"
# On an accelerator machine, a jax without the accelerator's plugin (one installed beside the
# machine's own, e.g. into a --target folder put first on PYTHONPATH) falls back to the host
# CPU with a warning only, and the tables would be the host's (the TPU run of 2026-12-07 at
# 2019f59 was). Refused here; ALLOW_CPU=1 runs anyway.
if [ "${ALLOW_CPU:-0}" != 1 ] && [ "$("$PY" -c 'import jax; print(jax.default_backend())' 2>/dev/null)" = cpu ]; then
  echo "error: jax runs on the CPU here (PYTHONPATH=${PYTHONPATH}): put the machine's own jax" \
       "first (append folders to PYTHONPATH, do not replace it), or ALLOW_CPU=1 to measure the host" >&2
  exit 3
fi
"$PY" benchmarks/save_restore.py --size="$SIZE" --reps="${REPS:-1}" --pause=1 \
  --json="$OUTDIR/device-$SIZE.json" > "$OUTDIR/device-$SIZE.log"
"$PY" benchmarks/report.py --runs "$SIZE=$OUTDIR/device-$SIZE.json"
