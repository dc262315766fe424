#!/usr/bin/env bash
# By hand, on the running multi-node cluster (hold /tmp/kr-slurm.lock): shows why that cluster
# needs MessageTimeout above KillWait. ~100 s.
#
#   flock -o /tmp/kr-slurm.lock bash tests/cluster/stale_kill_repro.sh [DIR]
#
# Run 0 of a 2-node --requeue job ends like a rank killed alone in tests/test_slurm_rescue.py:
# task 1 exits 9, `srun --kill-on-bad-exit` cancels the step, the batch script requeues the job
# (rank 0's part), and task 0 takes 4 s to leave after its SIGTERM (a rescue and teardown on a
# busy machine). slurmd answers both kills only when the step has ended; past MessageTimeout
# ("Socket timed out" in slurmctld.log, printed below), slurmctld sends the cancel again 60 s
# later by job and step id. When run 1 has started by then (SLURM finished run 0's cleanup
# within the minute: 1 of 2 tries here, 06:07 and 06:24 on 2026-11-24), its step 0 (same ids)
# gets SIGTERM: JobState=FAILED, exit 143; else the resend finds nothing and run 1 completes.
# With MessageTimeout above those 4 s no answer is late: nothing is resent, COMPLETED. The
# events file says which signal came when.
set -euo pipefail
eval "$(bash "$(dirname "${BASH_SOURCE[0]}")/multinode_cluster.sh" env)"
DIR=$(realpath -m "${1:-/tmp/kr-stale-kill}")
rm -rf "$DIR"; mkdir -p "$DIR"
scontrol show config | grep -E '^(MessageTimeout|KillWait|AuthInfo) '
cat >"$DIR/job.sbatch" <<'JOB'
#!/bin/bash
#SBATCH --nodes=2 --ntasks-per-node=1 --cpus-per-task=1 --requeue --open-mode=append --time=10
r=${SLURM_RESTART_COUNT:-0}
say() { echo "[$(date +%T.%N)] run $r $*" >> "$EV"; }
export -f say; export r
say "starts"
if [ "$r" = 0 ]; then
    srun --kill-on-bad-exit=1 bash -c '
        if [ "$SLURM_PROCID" = 1 ]; then sleep 2; say "task 1 exits 9"; exit 9; fi
        trap "say \"task 0 SIGTERM, leaving in 4 s\"; sleep 4; exit 143" TERM
        sleep 60 & wait' &
    sleep 2.3
    scontrol requeue "$SLURM_JOB_ID"
    wait
else
    srun bash -c 'trap "say \"task $SLURM_PROCID SIGTERM: a stale kill\"; exit 143" TERM
                  sleep 75 & wait; say "task $SLURM_PROCID finished"'
fi
JOB
LOG="${KR_MN_BASE:-/var/tmp/kr-multinode}/log/slurmctld.log"
seen=$(wc -l <"$LOG" 2>/dev/null || echo 0)
id=$(sbatch --parsable --export=ALL,EV="$DIR/events" --output="$DIR/job.out" "$DIR/job.sbatch")
echo "job $id: $DIR/events"
for _ in $(seq 1 240); do
    info=$(scontrol show -o job "$id" 2>/dev/null || true)
    state=$(grep -o 'JobState=[A-Z_]*' <<<"$info" || true)
    restarts=$(grep -o 'Restarts=[0-9]*' <<<"$info" || true)
    case "$state" in *=RUNNING|*=PENDING|*=REQUEUED|*=COMPLETING|*=CONFIGURING) ;;
        *) [ "$restarts" != Restarts=0 ] && break ;; esac
    sleep 1
done
echo "$state $restarts $(grep -o 'ExitCode=[0-9:]*' <<<"$info" || true)"
cat "$DIR/events"
tail -n +"$((seen + 1))" "$LOG" 2>/dev/null | grep -E 'Socket timed out|Resending' || echo "(no late answer)"
