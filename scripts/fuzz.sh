#!/usr/bin/env bash
# A long fuzz run (make fuzz): the hypothesis properties of the ps request handler
# (tests/unit/test_fuzz_request_handler.py) and of a real ps over ZeroMQ
# (tests/unit/test_fuzz_transport.py), with N examples per property. See docs/security.md.
#
#   scripts/fuzz.sh [N]        (default N = 20000)
#
# Prints the examples run per property and the wall time; exits non-zero if a property failed.
set -euo pipefail

examples="${1:-20000}"
if ! [[ "$examples" =~ ^[1-9][0-9]*$ ]]; then
  echo "usage: $0 [examples per property: a positive integer, default 20000]" >&2
  exit 2
fi
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${PYTHON:-$root/.venv/bin/python}"
files=(tests/unit/test_fuzz_request_handler.py tests/unit/test_fuzz_transport.py)
log="$(mktemp "${TMPDIR:-/tmp}/tensorfleet-fuzz.XXXXXX")"
trap 'rm -f "$log"' EXIT

cd "$root"
echo "fuzzing: $examples examples per property, ${files[*]}"
started=$(date +%s)
# -o timeout=0: a property with 20000 examples legitimately runs for minutes (a hang still
# shows: the run does not end).
set +e
TENSORFLEET_FUZZ_EXAMPLES="$examples" "$python" -m pytest -p no:cacheprovider -q \
  -o timeout=0 --hypothesis-show-statistics "${files[@]}" 2>&1 | tee "$log"
status=${PIPESTATUS[0]}
set -e
elapsed=$(( $(date +%s) - started ))

echo
echo "== fuzz summary: $examples examples per property =="
properties=0
total=0
name=""
while IFS= read -r line; do
  if [[ "$line" =~ ^tests/.*::([A-Za-z0-9_]+):$ ]]; then
    name="${BASH_REMATCH[1]}"
  elif [[ -n "$name" && "$line" =~ -\ ([0-9]+)\ passing,\ ([0-9]+)\ failing ]]; then
    printf '  %-76s %7d passing, %d failing\n' "$name" "${BASH_REMATCH[1]}" "${BASH_REMATCH[2]}"
    properties=$((properties + 1))
    total=$((total + BASH_REMATCH[1]))
    name=""
  fi
done < "$log"
echo "  $properties properties, $total passing examples, wall time ${elapsed} s"
echo "  pytest: $(grep -E '^[0-9]+ (passed|failed)|^=+ .*(passed|failed)' "$log" | tail -1 | tr -d '=' | xargs)"
if [ "$status" -eq 0 ]; then
  echo "  result: PASSED: no crash, hang or state change found"
else
  echo "  result: FAILED (pytest exit status $status): the failing examples are printed above"
fi
exit "$status"
