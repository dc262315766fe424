#!/usr/bin/env bash
# A real single-node SLURM cluster for the test suite: slurm_cluster.sh start|stop|status
#
# Facts this rests on are in slurm-cluster.md (measured on Debian 12, slurm 22.05, no systemd).
# Idempotent: `start` on a running, correctly configured cluster only waits for the node to be
# idle; `stop` on a stopped cluster does nothing. Needs root (daemons, /etc/slurm, apt-get).
#
# Environment knobs:
#   KR_SLURM_KILLWAIT   KillWait seconds (default 10: a job whose task ignores SIGTERM blocks
#                       the one-node queue this long, so tests want it short)
#   KR_SLURM_NO_INSTALL=1  never run apt-get (fail instead when slurm is missing)
set -euo pipefail

HOST="$(hostname -s)"
CONF_DIR=/etc/slurm
SPOOL_CTL=/var/spool/slurmctld
SPOOL_D=/var/spool/slurmd
LOG_DIR=/var/log/slurm
CTL_PID=/run/slurmctld.pid
D_PID=/run/slurmd.pid
MUNGE_PID=/run/munge/munged.pid
KILLWAIT="${KR_SLURM_KILLWAIT:-10}"

log() { echo "slurm_cluster: $*" >&2; }
die() { log "ERROR: $*"; exit 1; }

# A stopped daemon can linger as a zombie (no init reaps it here): `kill -0` says alive, so read
# the process state instead.
alive() {
    local pidfile=$1 pid state
    [[ -r $pidfile ]] || return 1
    pid=$(cat "$pidfile" 2>/dev/null) || return 1
    [[ -n $pid && -r /proc/$pid/status ]] || return 1
    state=$(awk '/^State:/ {print $2}' "/proc/$pid/status" 2>/dev/null) || return 1
    [[ -n $state && $state != Z && $state != X ]]
}

install_if_missing() {
    local missing=0 b
    for b in slurmctld slurmd scontrol sbatch munged; do
        command -v "$b" >/dev/null 2>&1 || PATH="$PATH:/usr/sbin" command -v "$b" >/dev/null 2>&1 \
            || missing=1
    done
    (( missing )) || return 0
    [[ ${KR_SLURM_NO_INSTALL:-0} == 1 ]] && die "slurm is not installed and KR_SLURM_NO_INSTALL=1"
    command -v apt-get >/dev/null || die "slurm is not installed and apt-get is not available"
    log "installing slurmctld slurmd slurm-client munge with apt-get"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >&2 || die "apt-get update failed"
    apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client munge >&2 \
        || die "apt-get install failed"
}

# proctrack/cgroup needs the cgroup v1 freezer; proctrack/pgid is the fallback. Never
# proctrack/linuxproc: a requeued job's Python child escaped it and kept running.
proctrack() {
    if grep -qE '^\S+ /sys/fs/cgroup/freezer cgroup .*freezer' /proc/mounts; then
        echo cgroup
    else
        echo pgid
    fi
}

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

start_munge() {
    alive "$MUNGE_PID" && return 0
    mkdir -p /run/munge /var/log/munge /var/lib/munge
    chown munge:munge /run/munge /var/log/munge /var/lib/munge 2>/dev/null || true
    chmod 0755 /run/munge
    if [[ ! -s /etc/munge/munge.key ]]; then
        log "creating /etc/munge/munge.key"
        if command -v mungekey >/dev/null; then
            runuser -u munge -- mungekey --create --force >&2
        else
            dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
            chown munge:munge /etc/munge/munge.key
            chmod 0400 /etc/munge/munge.key
        fi
    fi
    rm -f /run/munge/munge.socket.2.lock "$MUNGE_PID"
    runuser -u munge -- /usr/sbin/munged || die "munged failed to start (see /var/log/munge)"
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
    alive "$CTL_PID" || slurmctld || die "slurmctld failed to start; see $LOG_DIR/slurmctld.log"
    alive "$D_PID" || slurmd || die "slurmd failed to start; see $LOG_DIR/slurmd.log"
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
    if alive "$MUNGE_PID"; then
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
    *) echo "usage: $0 start|stop|status" >&2; exit 2 ;;
esac
