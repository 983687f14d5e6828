#!/usr/bin/env bash
# Downloads the wheels that the GPU machine's image lacks (bench/gpu/image_packages.txt lists what it has) for its
# Python and platform, at the versions pyproject.toml declares as minimums (their own dependencies at the versions
# pip resolves), into .gpu-wheels/ (ignored by git), and splits them into carries that fit beside the working tree.
# Prints the exact paths to carry and the command of each call, fewest calls first. Needs the network.
#
#     bash bench/gpu/prepare.sh                    # cp312 manylinux x86_64 (the GPU machine)
#     bash bench/gpu/prepare.sh --python 3.11      # another Python (the rehearsal here)
#     bash bench/gpu/prepare.sh --limit-mib 60     # what one call may carry, working tree included (default 60)
set -euo pipefail
cd "$(dirname "$0")/../.."

PYTHON_VERSION=3.12
LIMIT_MIB=60
DEST=.gpu-wheels
while [ $# -gt 0 ]; do
    case "$1" in
        --python) PYTHON_VERSION="$2"; shift 2 ;;
        --limit-mib) LIMIT_MIB="$2"; shift 2 ;;
        --dest) DEST="$2"; shift 2 ;;
        *) echo "prepare.sh: unknown argument $1 (see the comment at the top of bench/gpu/prepare.sh)" >&2; exit 2 ;;
    esac
done
PY=${PREPARE_PYTHON:-python3}
IMAGE_TORCH=2.11.0  # torch of the GPU machine's image (2.11.0+cu130)
TAG="cp${PYTHON_VERSION/./}"
ALL="$DEST/$TAG/all"
rm -rf "$ALL"
mkdir -p "$ALL"

# What vidtune needs (dependencies and every optional feature) that the image lacks, at the declared minimums.
"$PY" bench/gpu/minimums.py --not-in bench/gpu/image_packages.txt > "$DEST/$TAG/wanted.txt"
# DeepSpeed ships only a source archive: it is built into a wheel (pure Python; its kernels compile when used).
grep -v '^deepspeed==' "$DEST/$TAG/wanted.txt" > "$DEST/$TAG/binary.txt" || true
DEEPSPEED=$(grep '^deepspeed==' "$DEST/$TAG/wanted.txt" || true)

if [ -n "$DEEPSPEED" ]; then
    # Built without its kernels (DS_BUILD_OPS=0: they compile when first used).
    if ! DS_BUILD_OPS=0 "$PY" -m pip wheel --quiet --no-deps -w "$ALL" "$DEEPSPEED" >"$DEST/$TAG/deepspeed.log" 2>&1
    then
        echo "prepare.sh: could not build a wheel of $DEEPSPEED (see $DEST/$TAG/deepspeed.log); parallel.strategy=" \
             "deepspeed will not be measured there" >&2
    fi
fi
# The rest, and every dependency of theirs (and of DeepSpeed's) that the image lacks, for the target Python.
{ echo "torch==$IMAGE_TORCH"; "$PY" bench/gpu/minimums.py --only-in bench/gpu/image_packages.txt | grep -v '^torch=='; } \
    > "$DEST/$TAG/image-constraints.txt"
"$PY" bench/gpu/download.py "$ALL" --python-version "$PYTHON_VERSION" --image bench/gpu/image_packages.txt \
    -r "$DEST/$TAG/binary.txt" -c "$DEST/$TAG/image-constraints.txt" --image-needs "$DEST/$TAG/image-needs.txt"

# Split into carries: the working tree travels with every call; each carry is one folder of wheels.
"$PY" bench/gpu/carries.py "$ALL" --limit-mib "$LIMIT_MIB"
