#!/usr/bin/env bash
# The GPU run rehearsed on the CPU, in a virtual environment that holds what the GPU machine's image holds
# (bench/gpu/image_packages.txt) at its versions where known (torch 2.11.0, transformers 5.17.0,
# huggingface_hub 1.33.0, accelerate 1.15.0) and at pyproject.toml's declared minimums otherwise. Then, offline:
# the carried wheels install (bench/gpu/run.sh), `pip install -e .` resolves from the image and the carried wheels
# alone, run.sh --cpu runs end to end, and the tests in bench/gpu/minimum_tests.txt pass on these minimum versions.
# Needs the network for the environment and the wheels (cached by pip; the environment is kept in .venv-gpu-image).
#
#     bash bench/gpu/rehearse.sh [--budget 480] [--families ltx-video,wan] [--skip-tests] [--skip-run]
set -euo pipefail
cd "$(dirname "$0")/../.."
START=$SECONDS
BASE_PYTHON=${REHEARSAL_PYTHON:-python3.11}
VENV=.venv-gpu-image
BUDGET=480
# The tiny `lora` rows of two families (every family trains in the minimum-version tests): the rehearsal checks
# that each section runs, within CI's time.
FAMILIES=ltx-video,wan
RUN=1
TESTS=1
while [ $# -gt 0 ]; do
    case "$1" in
        --budget) BUDGET="$2"; shift 2 ;;
        --families) FAMILIES="$2"; shift 2 ;;
        --skip-tests) TESTS=0; shift ;;
        --skip-run) RUN=0; shift ;;
        *) echo "rehearse.sh: unknown argument $1" >&2; exit 2 ;;
    esac
done
# A subset of the suite that imports every module of vidtune/ (bench/gpu/minimum_tests.txt).
mapfile -t MINIMUM_TESTS < <(grep -v '^#' bench/gpu/minimum_tests.txt | grep .)
VERSION=$("$BASE_PYTHON" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
TAG="cp${VERSION/./}"

mkdir -p .gpu-wheels
echo "+ the wheels the image lacks, for Python $VERSION"
PREPARE_PYTHON=${PREPARE_PYTHON:-python3} bash bench/gpu/prepare.sh --python "$VERSION" | tee .gpu-wheels/prepare-$TAG.log
CALL=".gpu-wheels/$TAG/call1"
if [ "$(ls -d .gpu-wheels/"$TAG"/call* | wc -l)" != 1 ]; then
    echo "rehearse.sh: the wheels need more than one call; the rehearsal installs them all" >&2
fi

# The image's tools that the rehearsal uses: pytest (with pytest-xdist and pytest-timeout, as the suite runs) for the
# tests, setuptools and wheel to build vidtune offline. python-dateutil 2.9.0.post0: the image has no tzdata, which
# later releases need.
IMAGE_TOOLS="pytest pytest-xdist pytest-timeout setuptools wheel python-dateutil==2.9.0.post0"
STAMP="$VENV/.image-stamp"
WANT=$(echo "$IMAGE_TOOLS" | cat - bench/gpu/image_packages.txt .gpu-wheels/"$TAG"/image-constraints.txt .gpu-wheels/"$TAG"/image-needs.txt \
       | sha256sum)
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$WANT" ]; then
    echo "+ the image's packages in $VENV"
    rm -rf "$VENV"
    "$BASE_PYTHON" -m venv "$VENV"
    "$VENV/bin/python" -m pip install --quiet --upgrade pip
    "$VENV/bin/python" -m pip install --quiet -c .gpu-wheels/"$TAG"/image-constraints.txt \
        -r .gpu-wheels/"$TAG"/image-constraints.txt -r .gpu-wheels/"$TAG"/image-needs.txt $IMAGE_TOOLS
    # What pip brought in that the image does not have goes again, so a missing carry shows here as it would there.
    "$VENV/bin/python" - bench/gpu/image_packages.txt > .gpu-wheels/"$TAG"/not-in-image.txt <<'EOF'
import re, sys
from importlib import metadata
normalise = lambda name: re.sub(r"[-_.]+", "-", name.strip()).lower()
image = {normalise(line.split("#")[0]) for line in open(sys.argv[1]) if line.split("#")[0].strip()}
print("\n".join(sorted({normalise(d.metadata["Name"]) for d in metadata.distributions()} - image)))
EOF
    if [ -s .gpu-wheels/"$TAG"/not-in-image.txt ]; then
        "$VENV/bin/python" -m pip uninstall --quiet -y -r .gpu-wheels/"$TAG"/not-in-image.txt
    fi
    echo "$WANT" > "$STAMP"
fi
"$VENV/bin/python" -m pip list --format=freeze 2>/dev/null \
    | grep -iE '^(torch|transformers|huggingface.hub|accelerate|peft|safetensors|tokenizers|numpy)==' | tr '\n' ' '
echo

echo "+ offline: pip install -e . resolves from the image and the carried wheels alone (setuptools: the image's)"
"$VENV/bin/python" -m pip install --quiet --dry-run --no-index --no-build-isolation --find-links "$CALL" -e .

if [ "$RUN" = 1 ]; then
    echo "+ offline: bench/gpu/run.sh --cpu"
    rm -rf .gpu-site
    OUT=${OUT:-gpu-results} bash bench/gpu/run.sh --cpu --python "$VENV/bin/python" --budget "$BUDGET" \
        --families "$FAMILIES" --wheels "$CALL"
fi

if [ "$TESTS" = 1 ]; then
    # Their quick tests (the slow ones, whole runs and real-size plans, run in the suite on the newest versions).
    echo "+ the quick tests on the minimum versions: ${MINIMUM_TESTS[*]}"
    if [ ! -d .gpu-site ]; then
        "$VENV/bin/python" -m pip install --quiet --no-index --no-deps --no-compile --target .gpu-site "$CALL"/*.whl
    fi
    PYTHONPATH="$PWD:$PWD/.gpu-site:$PWD/bench/gpu" HF_HUB_OFFLINE=1 "$VENV/bin/python" -m pytest -q -n auto \
        -m "not slow" -p no:cacheprovider -p module_check "${MINIMUM_TESTS[@]}"
fi
echo "rehearse.sh: done in $((SECONDS - START)) s"
