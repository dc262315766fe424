# Shared by slurm_cluster.sh (one node) and multinode_cluster.sh (several nodes): sourced, not run.
#
# Facts this rests on are in slurm-cluster.md (measured on Debian 12, slurm 22.05, no systemd).
# The caller sets LOG_NAME (the prefix of its messages) before sourcing.

MUNGE_PID=/run/munge/munged.pid

log() { echo "${LOG_NAME:-slurm}: $*" >&2; }
die() { log "ERROR: $*"; exit 1; }

# A stopped daemon can linger as a zombie (no init reaps it here): `kill -0` says alive, so read
# the process state instead.
alive_pid() {
    local pid=$1 state
    [[ -n $pid && -r /proc/$pid/status ]] || return 1
    state=$(awk '/^State:/ {print $2}' "/proc/$pid/status" 2>/dev/null) || return 1
    [[ -n $state && $state != Z && $state != X ]]
}

alive() {
    local pidfile=$1 pid
    [[ -r $pidfile ]] || return 1
    pid=$(cat "$pidfile" 2>/dev/null) || return 1
    alive_pid "$pid"
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

# One munged serves every cluster on the machine (its socket is a pathname unix socket, which
# network namespaces share).
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
    # munged outlives this script and every cluster: it must not inherit our descriptors. The
    # suite runs these scripts under `flock /tmp/kr-slurm.lock ...`, whose lock a munged holding
    # that fd would keep forever (every later flock waits for good).
    (
        for fd in /proc/$BASHPID/fd/*; do
            fd=${fd##*/}
            (( fd > 2 )) && eval "exec $fd>&-" 2>/dev/null
        done
        exec runuser -u munge -- /usr/sbin/munged
    ) || die "munged failed to start (see /var/log/munge)"
}
