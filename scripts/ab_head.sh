#!/usr/bin/env bash
# GPU time (scripts/device_time.py) of the working tree's uncommitted changes against HEAD, on the
# same machine in one call: the workloads named run with the changes, then with them reverted, then
# with them again (so that drift shows), and the three tables are printed row by row. Only tracked
# files are reverted (`git diff`): a new file the changes add stays in all three passes.
#   bash scripts/ab_head.sh WORKLOAD...
# Tables go to $OUT (the device runner's output folder) when it is set, else /tmp/jaxstitch_ab.
# AB_DIFF=FILE: compare the changes in that patch instead (made beside the commits, e.g.
# `git diff > ab.diff` or `git diff HEAD~1 > ab.diff`): the device's checkout can hold the .git of the
# session's start, whose HEAD is older than the commits made since, and `git diff` there then holds
# them too.
set -u -o pipefail
cd "$(dirname "$0")/.." || exit 1
LOGS=${OUT:-/tmp/jaxstitch_ab}
mkdir -p "$LOGS"
python3 -m pip install -q --no-build-isolation --no-deps -e . >/dev/null 2>&1
if ! python3 -c "import flatbuffers" 2>/dev/null && ls .whl/flatbuffers-*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps .whl/flatbuffers-*.whl >/dev/null 2>&1
fi
if [ -n "${AB_DIFF:-}" ]; then cp "$AB_DIFF" "$LOGS/changes.diff"; else git diff > "$LOGS/changes.diff"; fi
[ -s "$LOGS/changes.diff" ] || { echo "no uncommitted changes to compare"; exit 1; }
times() { python3 scripts/device_time.py --only "$@" 2>&1 | grep "^|" | grep -v "^|---\|^| workload"; }
times "$@" > "$LOGS/changed.txt"
git apply -R "$LOGS/changes.diff" || exit 1
times "$@" > "$LOGS/head.txt"
git apply "$LOGS/changes.diff" || exit 1
times "$@" > "$LOGS/changed_again.txt"
echo "rows: changed, HEAD, changed again (GPU µs: jax.jit | jaxstitch)"
paste -d'\n' "$LOGS/changed.txt" "$LOGS/head.txt" "$LOGS/changed_again.txt" | cut -d'|' -f2-6
