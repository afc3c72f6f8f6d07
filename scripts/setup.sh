#!/usr/bin/env bash
# Install the toolkit into a virtual environment with the tested versions in constraints.txt.
#   bash scripts/setup.sh          # the toolkit         -> .venv
#   bash scripts/setup.sh --test   # plus test tools and what the extensions' tests need -> .venv
#   VENV=/some/dir bash scripts/setup.sh ...             -> another location
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
extras=""
if [ "${1:-}" = "--test" ]; then extras="[test]"; fi

[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
# constraints.txt pins torch==2.13.0: a looser requirement would make pip fetch a CUDA build
# and several GB of CUDA libraries on machines that have no GPU.
"$VENV/bin/pip" install --quiet --disable-pip-version-check -c constraints.txt -e ".$extras"
# The tests of extensions/ run with the others, so they need each extension's requirements.
if [ -n "$extras" ]; then
    for requirements in extensions/*/requirements.txt; do
        [ -f "$requirements" ] || continue
        "$VENV/bin/pip" install --quiet --disable-pip-version-check -c constraints.txt -r "$requirements"
    done
fi

# litdata requires torchvision, but only for image and video data, which the toolkit never reads.
# PyPI's torchvision is a CUDA build: next to a CPU-only torch its import fails ("operator
# torchvision::nms does not exist"), and so does any import that tries it. Keep it only where it
# works (a CUDA torch); otherwise remove it.
if ! "$VENV/bin/python" -c "import torchvision" >/dev/null 2>&1; then
    "$VENV/bin/pip" uninstall --quiet --yes torchvision
fi
"$VENV/bin/python" -c "import lightning_fabric, litdata, toolkit" || { echo "setup: the environment does not import" >&2; exit 1; }
echo "setup: ready in $VENV"
