#!/usr/bin/env bash
# The GPU check (benchmarks/gpu_check.py says what it runs; docs/where-it-runs.md, "On a GPU", what it found).
#
#   benchmarks/gpu_check.sh --prepare WHEELS_DIR [--python 3.12]   # where pip reaches a registry: the wheels
#   benchmarks/gpu_check.sh --wheels WHEELS_DIR OUT_DIR              # on the GPU machine, no network needed
#   benchmarks/gpu_check.sh --cpu OUT_DIR [--phases a,b]             # the same phases at their smallest (the suite)
#
# The GPU machine brings its own CUDA build of PyTorch (any version: the report prints the ones that ran);
# the wheels add what such an image lacks: gaeq, DeepSpeed (without prebuilt ops: nothing of it is compiled
# for this check, its optimizer is torch's own AdamW) and pydantic with its small dependencies, installed
# into a folder of their own that goes first on PYTHONPATH. Everything measured lands in OUT_DIR
# (report.json, report.md, summary.txt, each run's directory and log); the exit code is 1 when a verdict
# is wrong. Under 8 minutes on one H100.
set -euo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
export PIP_DISABLE_PIP_VERSION_CHECK=1

# What a CUDA image with PyTorch and transformers lacks, at the versions this checkout is tested with
# (read from the environment that prepares them).
MISSING=(pydantic pydantic-core annotated-types typing-inspection typing-extensions hjson)
DEEPSPEED_VERSION=0.19.8

prepare() {
    local wheels="$1" python="$2"
    mkdir -p "$wheels"
    local pins=()
    for name in "${MISSING[@]}"; do
        pins+=("$name==$(python3 -c "import importlib.metadata as m; print(m.version('$name'))")")
    done
    local platforms=()
    for p in manylinux_2_28_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_5_x86_64 manylinux1_x86_64; do
        platforms+=(--platform "$p")
    done
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$python" --implementation cp \
        "${platforms[@]}" -d "$wheels" "${pins[@]}"
    # DeepSpeed is published as a source distribution: built here into a wheel without ops (DS_BUILD_OPS=0),
    # for the cuda accelerator (what it records as installed for) — downloaded and built in one step (its
    # metadata is prepared once), never from pip's cache (a wheel built there for another accelerator).
    DS_BUILD_OPS=0 DS_ACCELERATOR=cuda python3 -m pip wheel -q --no-cache-dir --no-deps --no-binary=:all: \
        --no-build-isolation -w "$wheels" "deepspeed==$DEEPSPEED_VERSION"
    python3 -m pip wheel -q --no-deps --no-build-isolation -w "$wheels" "$REPO"
    du -sh "$wheels"
    ls "$wheels"
}

install() {
    local wheels="$1" site
    site="$(mktemp -d)/site"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" "$wheels"/*.whl
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
    echo "installed into $site: $(ls "$wheels" | tr '\n' ' ')"
}

case "${1:-}" in
    --prepare)
        python="3.12"
        [ "${3:-}" = "--python" ] && python="$4"
        prepare "$2" "$python"
        ;;
    --wheels)
        install "$2"
        shift 2
        cd "$REPO" && exec python3 benchmarks/gpu_check.py "$@"
        ;;
    --cpu)
        out="$2"
        shift 2
        cd "$REPO" && exec python3 benchmarks/gpu_check.py "$out" --cpu "$@"
        ;;
    -h|--help|"")
        sed -n '2,14p' "$0"
        ;;
    *)
        cd "$REPO" && exec python3 benchmarks/gpu_check.py "$@"
        ;;
esac
