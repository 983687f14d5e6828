#!/usr/bin/env bash
# The GPU run (bench/gpu/run.py), on a machine that reaches no package registry: installs the carried wheels
# (bench/gpu/prepare.sh made them) with --no-index --no-deps into .gpu-site/ (ignored by git) on top of the
# image's own packages, then measures within the time budget, writing $OUT/gpu_results.json and .md as it goes.
#
#     bash bench/gpu/run.sh --wheels .gpu-wheels/cp312/call1            # there (prepare.sh prints the call)
#     bash bench/gpu/run.sh --cpu --wheels .gpu-wheels/cp311/call1      # a rehearsal on the CPU
# Options: --budget SECONDS (default 480: the whole run, install included), --only SECTIONS and --families F,G
# (run.py's),
# --python PATH (default python3, which holds torch there), --out DIR (default $OUT, else gpu-results/).
set -euo pipefail
cd "$(dirname "$0")/../.."
START=$SECONDS
PY=python3
BUDGET=480
WHEELS=()
PASS=()
while [ $# -gt 0 ]; do
    case "$1" in
        --wheels) WHEELS+=("$2"); shift 2 ;;
        --python) PY="$2"; shift 2 ;;
        --budget) BUDGET="$2"; shift 2 ;;
        --out) OUT="$2"; shift 2 ;;
        --cpu) PASS+=(--cpu); shift ;;
        --only) PASS+=(--only "$2"); shift 2 ;;
        --families) PASS+=(--families "$2"); shift 2 ;;
        *) echo "run.sh: unknown argument $1 (see the comment at the top of bench/gpu/run.sh)" >&2; exit 2 ;;
    esac
done
OUT=${OUT:-gpu-results}
mkdir -p "$OUT"
SITE="$PWD/.gpu-site"
for folder in "${WHEELS[@]}"; do
    if ! compgen -G "$folder/*.whl" >/dev/null; then
        echo "run.sh: no wheels in $folder: carry it with the call (bench/gpu/prepare.sh prints the path)" >&2
        exit 2
    fi
    # Offline: only the carried files; their dependencies are the image's (prepare.sh checked which).
    "$PY" -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
        "$folder"/*.whl
done
export PYTHONPATH="$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
echo "run.sh: installed in $((SECONDS - START)) s; measuring for at most $((BUDGET - (SECONDS - START))) s"
set +e
# run.py keeps to the budget row by row; the timeout ends a row that overruns it (the files keep what was done).
timeout --kill-after=10 $((BUDGET - (SECONDS - START))) "$PY" bench/gpu/run.py --out "$OUT" \
    --budget $((BUDGET - (SECONDS - START) - 10)) "${PASS[@]}" 2>&1 | tee "$OUT/gpu_run.log"
status=${PIPESTATUS[0]}
echo "run.sh: exit $status after $((SECONDS - START)) s; results: $OUT/gpu_results.md"
exit "$status"
