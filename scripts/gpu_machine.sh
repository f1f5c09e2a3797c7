#!/usr/bin/env bash
# The GPU check on a bare GPU machine without internet, in two steps.
#
#   scripts/gpu_machine.sh prepare   # here, with internet: the wheels the GPU machine lacks
#                                    # (.gpu-wheels/) and Fashion-MNIST (.gpu-data/)
#   scripts/gpu_machine.sh run       # there, from a copy of the repository that carries both:
#                                    # install the wheels offline, run benchmarks/gpu.py
#
# The GPU machine is expected to have Python 3.12 with torch (CUDA), numpy, msgpack,
# safetensors, rich, pytest and pytest-timeout, but not pyzmq, cryptography, cffi, pycparser
# and xxhash: `prepare` downloads those five (and py-spy, for gpu.py --profile) as CPython 3.12
# x86-64 wheels, `run` installs
# them with `pip install --no-index --no-deps --target .gpu-site` (nothing leaves the
# machine; a Python that already imports zmq and cryptography installs py-spy, and xxhash
# where it does not import it, only). `run` writes
# the results to $OUT when set (else benchmarks/results/gpu-run), then (unless
# CPU_BIG_MODEL=0) runs benchmarks/big_model.py on the host's CPU cores into
# big_model_cpu/ there (one process, 1 ps, 2 ps; 5 minutes at most), and exits with
# benchmarks/gpu.py's status (77: no CUDA GPU there, with the reason printed).
#
# Environment: PYTHON (default python3), DATA_SOURCE for prepare (default
# /usr/share/datasets/fashion-mnist: the four idx .gz files).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
WHEELS="$ROOT/.gpu-wheels"
DATA="$ROOT/.gpu-data"
SITE="$ROOT/.gpu-site"
#: The versions that worked on a machine with one H200, Python 3.12 and torch 2.11 (CUDA 13);
#: py-spy (a static binary in its wheel) for benchmarks/gpu.py --profile; xxhash for the ps
#: update log's checksum (imported by every ps).
PACKAGES=(pyzmq==27.3.0 cryptography==50.0.2 cffi==2.1.1 pycparser==3.12 py-spy==0.4.3
          xxhash==4.1.0)
DATA_FILES=(train-images-idx3-ubyte.gz train-labels-idx1-ubyte.gz
            t10k-images-idx3-ubyte.gz t10k-labels-idx1-ubyte.gz)

prepare() {
    local source="${DATA_SOURCE:-/usr/share/datasets/fashion-mnist}"
    mkdir -p "$WHEELS" "$DATA"
    "$PYTHON" -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64 \
        --platform manylinux1_x86_64 --platform any \
        -d "$WHEELS" "${PACKAGES[@]}"
    for name in "${DATA_FILES[@]}"; do
        if [[ ! -f "$source/$name" ]]; then
            echo "gpu_machine.sh: $source/$name is missing: set DATA_SOURCE to the directory" \
                 "holding Fashion-MNIST's four idx .gz files" >&2
            exit 2
        fi
        cp "$source/$name" "$DATA/"
    done
    echo "prepared: $(ls "$WHEELS" | wc -l) wheels in .gpu-wheels, 4 data files in .gpu-data;" \
         "carry both to the GPU machine and run: scripts/gpu_machine.sh run"
}

run() {
    for dir in "$WHEELS" "$DATA"; do
        if [[ ! -d "$dir" ]]; then
            echo "gpu_machine.sh: $dir is missing: run 'scripts/gpu_machine.sh prepare' where" \
                 "there is internet, and carry .gpu-wheels and .gpu-data with the repository" >&2
            exit 2
        fi
    done
    if "$PYTHON" -c "import zmq, cryptography" 2>/dev/null; then
        local wanted=("$WHEELS"/py_spy-*.whl)
        if ! "$PYTHON" -c "import xxhash" 2>/dev/null; then
            wanted+=("$WHEELS"/xxhash-*.whl)
        fi
        echo "gpu_machine.sh: $PYTHON already has pyzmq and cryptography: installing" \
             "${wanted[*]##*/} only"
        "$PYTHON" -m pip install --quiet --no-index --no-deps --target "$SITE" "${wanted[@]}"
    else
        "$PYTHON" -m pip install --quiet --no-index --no-deps --target "$SITE" "$WHEELS"/*.whl
    fi
    mkdir -p "$SITE/bin"
    printf '#!/bin/sh\nexec %s -m tensorfleet "$@"\n' "$(command -v "$PYTHON")" > "$SITE/bin/tensorfleet"
    chmod +x "$SITE/bin/tensorfleet"
    export PYTHONPATH="$SITE:$ROOT/src${PYTHONPATH:+:$PYTHONPATH}"
    export PATH="$SITE/bin:$PATH"
    export TENSORFLEET_DATA_DIR="$DATA"
    local out="${OUT:-$ROOT/benchmarks/results/gpu-run}"
    cd "$ROOT"
    nvidia-smi -L 2>/dev/null || true
    local status=0
    "$PYTHON" benchmarks/gpu.py --data-dir "$DATA" --out-dir "$out" "$@" || status=$?
    if [[ "$status" -ne 77 && "${CPU_BIG_MODEL:-1}" != 0 ]]; then
        # The data plane's big model on this host's cores (no GPU): one process, 1 ps, 2 ps,
        # two interleaved rounds; at most 5 minutes.
        echo "gpu_machine.sh: the BERT-base-sized model on the CPU cores (300 s at most)"
        timeout 300 "$PYTHON" benchmarks/big_model.py --runs torch ps1 ps2 --steps 8 --warmup 2 \
            --repeats 2 --timeout 90 --out-dir "$out/big_model_cpu" \
            || echo "gpu_machine.sh: the CPU big-model run failed or timed out (status $?)" >&2
    fi
    return "$status"
}

usage() {
    cat <<'USAGE'
usage: scripts/gpu_machine.sh prepare | run [benchmarks/gpu.py options]

The GPU check on a bare GPU machine without internet, in two steps:
  prepare   here, with internet: download pyzmq, cryptography, cffi, pycparser, xxhash and py-spy as
            CPython 3.12 x86-64 wheels into .gpu-wheels/, copy Fashion-MNIST into
            .gpu-data/ (from $DATA_SOURCE, default /usr/share/datasets/fashion-mnist)
  run       there, from a copy of the repository carrying both folders: install the
            wheels offline into .gpu-site/, then run benchmarks/gpu.py (options after
            'run' go to it), then benchmarks/big_model.py on the CPU cores (one process,
            1 ps, 2 ps; skipped with CPU_BIG_MODEL=0); results in $OUT, else
            benchmarks/results/gpu-run; exits with gpu.py's status (77: no CUDA GPU there)
Environment: PYTHON (default python3), DATA_SOURCE, OUT, CPU_BIG_MODEL. See docs/gpu.md.
USAGE
}

case "${1:-}" in
    prepare) shift; prepare "$@" ;;
    run) shift; run "$@" ;;
    -h|--help|help) usage ;;
    *) usage >&2; exit 2 ;;
esac
