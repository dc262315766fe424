#!/usr/bin/env bash
# A real single-node SLURM cluster for the test suite: slurm_cluster.sh start|stop|status|install
#
# Facts this rests on are in slurm-cluster.md (measured on Debian 12, slurm 22.05, no systemd).
# Idempotent: `start` on a running, correctly configured cluster only waits for the node to be
# idle; `stop` on a stopped cluster does nothing; `install` only installs the packages (start
# does too, when they are missing). Needs root (daemons, /etc/slurm, apt-get).
#
# Environment knobs:
#   KR_SLURM_KILLWAIT   KillWait seconds (default 10: a job whose task ignores SIGTERM blocks
#                       the one-node queue this long, so tests want it short)
#   KR_SLURM_NO_INSTALL=1  never run apt-get (fail instead when slurm is missing)
set -euo pipefail
# This cluster is the default one (/etc/slurm); SLURM_CONF would point its clients elsewhere.
unset SLURM_CONF

HOST="$(hostname -s)"
CONF_DIR=/etc/slurm
# State of our own: another SLURM install's /var/spool/slurmctld (another ClusterName) made
# slurmctld stop with "CLUSTER NAME MISMATCH", and its old jobs would come back in ours.
SPOOL_CTL=/var/spool/kempner-slurm/slurmctld
SPOOL_D=/var/spool/kempner-slurm/slurmd
LOG_DIR=/var/log/slurm
CTL_PID=/run/slurmctld.pid
D_PID=/run/slurmd.pid
KILLWAIT="${KR_SLURM_KILLWAIT:-10}"

LOG_NAME=slurm_cluster
# shellcheck source=slurm_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/slurm_common.sh"

write_conf() {
    local pt tmp changed=0
    pt=$(proctrack)
    mkdir -p "$CONF_DIR"
    tmp=$(mktemp)
    cat >"$tmp" <<EOF
# Written by kempner_resilience tests/cluster/slurm_cluster.sh; see slurm-cluster.md.
ClusterName=kempner
SlurmctldHost=$HOST
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# cred_expire: the default 120 also holds a requeued job back 121 s before it may run again.
AuthInfo=cred_expire=5
StateSaveLocation=$SPOOL_CTL
SlurmdSpoolDir=$SPOOL_D
SlurmctldPidFile=$CTL_PID
SlurmdPidFile=$D_PID
SlurmctldLogFile=$LOG_DIR/slurmctld.log
SlurmdLogFile=$LOG_DIR/slurmd.log
ProctrackType=proctrack/$pt
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
MailProg=/bin/true
JobRequeue=1
# KillWait: SIGTERM -> SIGKILL delay; short so a stuck job does not stall the one-node queue.
KillWait=$KILLWAIT
ReturnToService=2
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
# Fast scheduling: a trivial job completes in < 1 s instead of ~3 s.
SchedulerParameters=batch_sched_delay=0,bf_interval=1,sched_interval=2
# Let 8 one-CPU test jobs share the real cores.
SlurmdParameters=config_overrides
# Real preemption: a job in 'high' requeues one in 'low', which gets its --signal first.
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
SlurmctldParameters=preempt_send_user_signal
NodeName=$HOST CPUs=8 State=UNKNOWN
PartitionName=low Nodes=$HOST Default=YES MaxTime=INFINITE State=UP PriorityTier=1 GraceTime=15
PartitionName=high Nodes=$HOST MaxTime=INFINITE State=UP PriorityTier=2 PreemptMode=OFF
EOF
    if ! cmp -s "$tmp" "$CONF_DIR/slurm.conf"; then
        install -m 0644 "$tmp" "$CONF_DIR/slurm.conf"
        changed=1
    fi
    cat >"$tmp" <<EOF
CgroupPlugin=cgroup/v1
CgroupAutomount=no
ConstrainCores=no
ConstrainRAMSpace=no
ConstrainSwapSpace=no
ConstrainDevices=no
EOF
    if ! cmp -s "$tmp" "$CONF_DIR/cgroup.conf"; then
        install -m 0644 "$tmp" "$CONF_DIR/cgroup.conf"
        changed=1
    fi
    rm -f "$tmp"
    echo $changed
}

wait_idle() {
    local deadline=$((SECONDS + ${1:-30})) st
    while (( SECONDS < deadline )); do
        st=$(sinfo -h -n "$HOST" -o '%T' 2>/dev/null | head -n1 || true)
        case "$st" in
            idle|mixed|allocated|completing) return 0 ;;
            down*|drain*|fail*)
                # Left over from an earlier run (ReturnToService=2 covers most): resume it.
                scontrol update NodeName="$HOST" State=RESUME >/dev/null 2>&1 || true ;;
        esac
        sleep 0.2
    done
    die "node $HOST not idle after ${1:-30}s (state: ${st:-none}); see $LOG_DIR/*.log"
}

cmd_start() {
    [[ $(id -u) == 0 ]] || die "must run as root (starts daemons, writes /etc/slurm)"
    local t0=$SECONDS changed
    install_if_missing
    changed=$(write_conf)
    mkdir -p "$SPOOL_CTL" "$SPOOL_D" "$LOG_DIR"
    start_munge
    if (( changed )) && { alive "$CTL_PID" || alive "$D_PID"; }; then
        # Daemons read AuthInfo (and most settings) only at start: restart them.
        log "configuration changed: restarting the daemons"
        cmd_stop_daemons
    fi
    alive "$CTL_PID" || without_inherited_fds slurmctld \
        || die "slurmctld failed to start; see $LOG_DIR/slurmctld.log"
    alive "$D_PID" || without_inherited_fds slurmd || die "slurmd failed to start; see $LOG_DIR/slurmd.log"
    wait_idle 60
    log "cluster up on $HOST ($((SECONDS - t0)) s, proctrack/$(proctrack))"
}

cmd_stop_daemons() {
    local deadline
    if alive "$CTL_PID" || alive "$D_PID"; then
        scontrol shutdown >/dev/null 2>&1 || true
    fi
    deadline=$((SECONDS + 20))
    while (alive "$CTL_PID" || alive "$D_PID") && (( SECONDS < deadline )); do sleep 0.2; done
    local f
    for f in "$CTL_PID" "$D_PID"; do
        if alive "$f"; then
            log "daemon $(cat "$f") did not stop; sending SIGKILL"
            kill -9 "$(cat "$f")" 2>/dev/null || true
        fi
    done
}

cmd_stop() {
    if alive "$CTL_PID"; then
        # `scontrol shutdown` leaves running jobs alive, and they come back at the next start.
        local ids deadline
        ids=$(squeue -h -o '%A' 2>/dev/null || true)
        if [[ -n $ids ]]; then
            # shellcheck disable=SC2086
            scancel $ids >/dev/null 2>&1 || true
        fi
        deadline=$((SECONDS + KILLWAIT + 30))
        while [[ -n $(squeue -h -o '%A' 2>/dev/null || true) ]] && (( SECONDS < deadline )); do
            sleep 0.3
        done
    fi
    cmd_stop_daemons
    # Forget old jobs so the next start is clean.
    rm -rf "${SPOOL_CTL:?}"/* "${SPOOL_D:?}"/* 2>/dev/null || true
    # munged also serves the multi-node test cluster (multinode_cluster.sh) when that runs.
    if alive "$MUNGE_PID" && ! pgrep -x 'slurmctld|slurmd' >/dev/null; then
        kill "$(cat "$MUNGE_PID")" 2>/dev/null || true
    fi
    log "cluster stopped"
}

cmd_status() {
    local ok=0
    alive "$MUNGE_PID" && echo "munged: running" || { echo "munged: stopped"; ok=1; }
    alive "$CTL_PID" && echo "slurmctld: running" || { echo "slurmctld: stopped"; ok=1; }
    alive "$D_PID" && echo "slurmd: running" || { echo "slurmd: stopped"; ok=1; }
    if (( ok == 0 )); then
        sinfo 2>/dev/null || ok=1
        squeue 2>/dev/null || true
    fi
    return $ok
}

case "${1:-}" in
    start) cmd_start ;;
    stop) cmd_stop ;;
    status) cmd_status ;;
    install) install_if_missing ;;
    *) echo "usage: $0 start|stop|status|install" >&2; exit 2 ;;
esac
