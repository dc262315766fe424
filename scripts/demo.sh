#!/usr/bin/env bash
# The main job: a small real training run that is interrupted, checkpoints, is relaunched and
# resumes, ending with weights identical to an uninterrupted run. Installs what it needs.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/kempner-resilience demo "$@"
