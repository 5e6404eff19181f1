#!/usr/bin/env bash
# What `pip install .` gives a user must import and run: builds jaxstitch's wheel from a clean copy of
# the tree (git's files only, so no stale build/ output can hide a missing package), installs it in a
# fresh virtual environment and runs examples/quickstart.py from a temporary directory against it.
# The environment sees this machine's jax, NVRTC and flax (--system-site-packages: nothing is
# downloaded), but its own jaxstitch must win over the editable install of the source tree.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS
PY=${PYTHON:-python3}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

mkdir "$work/src"
git ls-files -z --cached --others --exclude-standard \
    | while IFS= read -r -d '' f; do [[ -e $f ]] && printf '%s\0' "$f"; done \
    | xargs -0 cp --parents -t "$work/src"
built_here=$(ls jaxstitch/kernels/_launcher*.so 2>/dev/null | head -n1 || true)
"$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$work/wheels" "$work/src"
wheel=$(ls "$work"/wheels/jaxstitch-*.whl)
echo "wheel check: built $(basename "$wheel") in $((SECONDS - start)) s"

"$PY" -m venv --system-site-packages --without-pip "$work/venv"
"$PY" -m pip --python "$work/venv/bin/python" install -q --no-deps --ignore-installed "$wheel"

mkdir "$work/run"
cp examples/quickstart.py "$work/run/"
cd "$work/run"
JAXSTITCH_SRC="$OLDPWD" VENV="$work/venv" NEEDS_LAUNCHER="${built_here:+1}" \
    "$work/venv/bin/python" "$OLDPWD/.ci/wheel_check.py" quickstart.py
echo "wheel check: passed in $((SECONDS - start)) s"
