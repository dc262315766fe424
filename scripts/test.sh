#!/usr/bin/env bash
# The whole test suite on a fresh machine: installs what it needs, starts a real single-node
# SLURM cluster for the SLURM tests (apt packages; root), runs pytest.
#
# With no arguments the suite runs as three shards side by side (tests/conftest.py splits it):
# the tests of the single-node SLURM cluster, the tests of the multi-node cluster (each serial:
# they share their cluster), and everything else on two pytest workers. Much SLURM test time is
# spent waiting on the scheduler, so the split shortens the wall time on two cores. With
# arguments it is one plain pytest run of what they select.
set -euo pipefail
cd "$(dirname "$0")/.."
# SLURM's packages, for the clusters the SLURM tests start (as root), download while setup.sh
# installs Python's: a fresh machine waits for the two at once. Its failure is the SLURM
# tests' to report, with the reason, when their cluster cannot start.
slurm_install=
if [ "$#" -eq 0 ] && [ "$(id -u)" = 0 ]; then
    bash tests/cluster/slurm_cluster.sh install >/dev/null 2>&1 &
    slurm_install=$!
fi
bash scripts/setup.sh
[ -z "$slurm_install" ] || wait "$slurm_install" || true
PY=.venv/bin/python
# What setup.sh did not compile (a module the suite imports for the first time) is compiled
# once and written, not again in each of the suite's processes.
unset PYTHONDONTWRITEBYTECODE
if [ "$#" -gt 0 ]; then
    exec "$PY" -m pytest -q "$@"
fi

logs=$(mktemp -d)
# Each shard also records the CPU time of its processes (bash's `times`: the children's user and
# system seconds), so a slow CI run says whether the shards were short of CPU or waiting.
shard() {
    local rc=0
    KR_TEST_SHARD=$1 "$PY" -m pytest -q -p no:cacheprovider --junitxml="$logs/$1.xml" "${@:2}" \
        >"$logs/$1.log" 2>&1 || rc=$?
    times >"$logs/$1.times"
    return $rc
}
# The rest runs on two pytest workers (pytest-xdist), a test file at a time each: its time is
# CPU, and one worker alone would leave a core idle once the SLURM shards are done.
# In the order tests/conftest.py gives (the slowest files first), not xdist's (most tests first).
(shard local -n "${KR_TEST_LOCAL_WORKERS:-2}" --dist loadfile --no-loadscope-reorder) &
local_pid=$!
(shard multinode) &
multi_pid=$!
# Whatever ends this script ends the other shards too, so no pytest outlives it.
trap 'for p in "$local_pid" "$multi_pid"; do pkill -P "$p" 2>/dev/null || true; kill "$p" 2>/dev/null || true; done' EXIT
set +e
echo "== SLURM tests of the single-node cluster (the other shards run alongside) =="
KR_TEST_SHARD=slurm "$PY" -m pytest -q -p no:cacheprovider --junitxml="$logs/slurm.xml"
slurm_rc=$?
times >"$logs/slurm.times"
wait "$multi_pid"
multi_rc=$?
wait "$local_pid"
local_rc=$?
set -e
echo
echo "== SLURM tests of the multi-node cluster =="
cat "$logs/multinode.log"
echo
echo "== Tests without SLURM =="
cat "$logs/local.log"
echo
for shard in slurm multinode local; do
    echo "== $shard shard =="
    "$PY" scripts/slowest_files.py "$logs/$shard.xml" 2>/dev/null || echo "(no report)"
    # The second line of `times`: user and system time of the shard's reaped processes.
    echo "CPU time of its processes (user, system): $(sed -n 2p "$logs/$shard.times" 2>/dev/null)"
done
# KR_TEST_REPORTS=DIR keeps each shard's JUnit report (every test's duration) there.
if [ -n "${KR_TEST_REPORTS:-}" ]; then
    mkdir -p "$KR_TEST_REPORTS" && cp "$logs"/*.xml "$KR_TEST_REPORTS"/ 2>/dev/null || true
fi
rm -rf "$logs"
echo
echo "SLURM tests: exit $slurm_rc; multi-node SLURM tests: exit $multi_rc; other tests: exit $local_rc"
[ "$slurm_rc" -eq 0 ] && [ "$multi_rc" -eq 0 ] && [ "$local_rc" -eq 0 ]
