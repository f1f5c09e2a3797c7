#!/usr/bin/env bash
# Measure TensorFlow's own distributed runtime on the classic example, for comparison.
#
#   benchmarks/tf_reference/run.sh [STEPS] [WORKERS] [async|sync|single]
#
# Needs a Python with tensorflow-cpu (set TF_PYTHON; default: the separate venv
# .venv-tf of this repository, which `make tf-reference` makes with
# `pip install tensorflow-cpu`, never touching the project's torch). Prints one JSON line per
# worker; the chief's line has global_steps_per_s and test_accuracy.
# Ports 22220+ on localhost; override with TF_BASE_PORT.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
steps="${1:-2000}"; n="${2:-3}"; mode="${3:-async}"
root="$(cd "$here/../.." && pwd)"
py="${TF_PYTHON:-$root/.venv-tf/bin/python}"
if [ ! -x "$py" ]; then
  echo "no Python with tensorflow at $py: run \`make tf-reference\` (or set TF_PYTHON)" >&2
  exit 3
fi
if [ "$mode" = single ]; then
  exec "$py" "$here/classic_example_tf.py" --single --steps "$steps" --threads 2
fi
base="${TF_BASE_PORT:-22220}"
ps="localhost:$base"; workers=""
for i in $(seq 1 "$n"); do workers="${workers:+$workers,}localhost:$((base + i))"; done
extra=(); [ "$mode" = sync ] && extra=(--sync)
"$py" "$here/classic_example_tf.py" --job_name ps --task_index 0 --ps "$ps" --workers "$workers" >/dev/null 2>&1 &
ps_pid=$!
trap 'kill $ps_pid 2>/dev/null || true' EXIT
pids=()
for i in $(seq 0 $((n - 1))); do
  "$py" "$here/classic_example_tf.py" --job_name worker --task_index "$i" --ps "$ps" --workers "$workers" \
      --steps "$steps" "${extra[@]}" 2>>"${TF_LOG:-/dev/null}" &
  pids+=($!)
done
# The chief's line carries the figures. TensorFlow's non-chief workers can hang when they
# join after the last step (seen with short runs), so they get a grace period, then a kill.
status=0
wait "${pids[0]}" || status=$?
for pid in "${pids[@]:1}"; do
  for _ in $(seq 1 60); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
  if kill -0 "$pid" 2>/dev/null; then
    echo "{\"peer\": \"tensorflow\", \"note\": \"a non-chief worker still hung 30 s after the chief finished; killed\"}"
    kill "$pid" 2>/dev/null || true
  fi
done
exit $status
