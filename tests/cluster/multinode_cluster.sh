#!/usr/bin/env bash
# A real multi-node SLURM cluster on one machine, for the test suite:
#
#   multinode_cluster.sh start|stop|status|env
#   multinode_cluster.sh kill-node K      SIGKILL every process of node K (a dead node)
#   multinode_cluster.sh restart-node K   start node K's slurmd again (idle at once)
#
# One slurmctld in the host's network namespace and N slurmd "nodes" krnode1..krnodeN, each in
# its own network namespace (a veth pair on a bridge, a private /24: the bridge is .1, node K is
# .(10+K)) and its own UTS namespace (its own host name, so gloo binds to the node's address, as
# on a real cluster). Host names resolve through marker lines in /etc/hosts (every namespace
# shares it). The config, state, spool, pid and log files live under $KR_MN_BASE; the ports are
# not the default ones, so the single-node cluster of slurm_cluster.sh (/etc/slurm, 6817/6818)
# runs beside it. Clients and jobs need SLURM_CONF=$KR_MN_BASE/etc/slurm.conf (`env` prints it).
# munged is shared with that cluster (pathname unix sockets cross network namespaces) and left
# running by `stop`.
#
# Idempotent: `start` on a running, correctly configured cluster only restarts what is missing
# (a killed node's slurmd) and waits for every node to be idle; `stop` tears down daemons, jobs,
# namespaces, links and the /etc/hosts lines and forgets all jobs, and does nothing when nothing
# runs. Needs root. Facts this rests on: slurm-cluster.md, "Several nodes on one machine".
#
# Environment knobs:
#   KR_MN_BASE      state directory (default /var/tmp/kr-multinode)
#   KR_MN_NODES     number of nodes (default 3)
#   KR_MN_NET       the /24's first three octets (default 10.213.47)
#   KR_MN_CTL_PORT  slurmctld port (default 7817); slurmd listens on the next one
#   KR_MN_KILLWAIT  KillWait seconds (default 5)
#   KR_MN_SLURMD_TIMEOUT  SlurmdTimeout seconds (default 5; production clusters use 300: a
#                   dead node stays "responding" that long, see tests/test_slurm_spares.py)
#   KR_SLURM_NO_INSTALL=1  never run apt-get (fail instead when slurm is missing)
set -euo pipefail

HOST="$(hostname -s)"
BASE="${KR_MN_BASE:-/var/tmp/kr-multinode}"
NODES="${KR_MN_NODES:-3}"
NET="${KR_MN_NET:-10.213.47}"
CTL_PORT="${KR_MN_CTL_PORT:-7817}"
D_PORT=$((CTL_PORT + 1))
KILLWAIT="${KR_MN_KILLWAIT:-5}"
# Above KillWait, with room for a loaded machine: see MessageTimeout in write_conf.
MSG_TIMEOUT=$((KILLWAIT + 5 > 10 ? KILLWAIT + 5 : 10))
SLURMD_TIMEOUT="${KR_MN_SLURMD_TIMEOUT:-5}"
PREFIX=krnode
BRIDGE=krmn0
MARK="# kr-multinode"
CONF_DIR="$BASE/etc"
CONF="$CONF_DIR/slurm.conf"
STATE="$BASE/slurmctld"
RUN="$BASE/run"
LOGS="$BASE/log"
CTL_PID="$RUN/slurmctld.pid"
export SLURM_CONF="$CONF"

LOG_NAME=multinode_cluster
# shellcheck source=slurm_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/slurm_common.sh"

[[ $NODES =~ ^[0-9]+$ ]] && (( NODES >= 1 && NODES <= 200 )) || die "KR_MN_NODES=$NODES: 1..200"

node_name() { echo "$PREFIX$1"; }
node_addr() { echo "$NET.$((10 + $1))"; }
node_pidfile() { echo "$RUN/slurmd-$(node_name "$1").pid"; }
host_veth() { echo "krmn$1"; }

# ------------------------------------------------------------------------------ network

setup_bridge() {
    if ! ip link show "$BRIDGE" >/dev/null 2>&1; then
        ip link add "$BRIDGE" type bridge || die "cannot create bridge $BRIDGE (ip link add)"
    fi
    # Not `ip ... | grep -q`: with pipefail, grep's early exit can fail the pipeline (SIGPIPE).
    [[ $(ip addr show dev "$BRIDGE") == *"inet $NET.1/24"* ]] \
        || ip addr add "$NET.1/24" dev "$BRIDGE"
    ip link set "$BRIDGE" up
}

setup_node_net() {
    local k=$1 name veth
    name=$(node_name "$k")
    veth=$(host_veth "$k")
    [[ -e /run/netns/$name ]] || ip netns add "$name" || die "ip netns add $name failed"
    if ! ip -n "$name" link show eth0 >/dev/null 2>&1; then
        ip link del "$veth" >/dev/null 2>&1 || true
        ip link add "$veth" type veth peer name "${veth}c"
        ip link set "${veth}c" netns "$name"
        # The same interface name on every node, as on a real cluster.
        ip -n "$name" link set "${veth}c" name eth0
        ip -n "$name" addr add "$(node_addr "$k")/24" dev eth0
    fi
    ip -n "$name" link set lo up
    ip -n "$name" link set eth0 up
    ip link set "$veth" master "$BRIDGE"
    ip link set "$veth" up
}

# /etc/hosts may be a bind mount: rewrite it in place (same inode), never replace it.
write_hosts() {
    local want k kept
    want=""
    for ((k = 1; k <= NODES; k++)); do
        want+="$(node_addr "$k") $(node_name "$k") $MARK"$'\n'
    done
    kept=$(grep -v -F "$MARK" /etc/hosts || true)
    if [[ "$(grep -F "$MARK" /etc/hosts || true)"$'\n' != "$want" ]]; then
        printf '%s\n%s' "$kept" "$want" >/etc/hosts
    fi
}

remove_hosts() {
    local kept
    grep -q -F "$MARK" /etc/hosts || return 0
    kept=$(grep -v -F "$MARK" /etc/hosts || true)
    printf '%s\n' "$kept" >/etc/hosts
}

# ------------------------------------------------------------------------------ config

cgroup_conf_text() {
    cat <<EOF
CgroupPlugin=cgroup/v1
CgroupAutomount=no
ConstrainCores=no
ConstrainRAMSpace=no
ConstrainSwapSpace=no
ConstrainDevices=no
EOF
}

write_conf() {
    local pt tmp changed=0 k nodes
    pt=$(proctrack)
    mkdir -p "$CONF_DIR"
    tmp=$(mktemp)
    nodes="$PREFIX[1-$NODES]"
    (( NODES == 1 )) && nodes="${PREFIX}1"
    {
        cat <<EOF
# Written by kempner_resilience tests/cluster/multinode_cluster.sh; see slurm-cluster.md.
ClusterName=krmultinode
SlurmctldHost=$HOST($NET.1)
SlurmctldPort=$CTL_PORT
SlurmdPort=$D_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# cred_expire: the default 120 also holds a requeued job back 121 s before it may run again.
AuthInfo=cred_expire=5
StateSaveLocation=$STATE
# %n: the node's name (one slurmd per node on this machine).
SlurmdSpoolDir=$BASE/spool/%n
SlurmctldPidFile=$CTL_PID
SlurmdPidFile=$RUN/slurmd-%n.pid
SlurmctldLogFile=$LOGS/slurmctld.log
SlurmdLogFile=$LOGS/slurmd-%n.log
ProctrackType=proctrack/$pt
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
MailProg=/bin/true
JobRequeue=1
KillWait=$KILLWAIT
ReturnToService=2
# A dead node is DOWN about 25 s after it stops answering (12 s with MessageTimeout=3; SLURM's
# defaults: minutes), and its --requeue jobs are requeued then.
# KR_MN_SLURMD_TIMEOUT=300: five minutes, as in production.
SlurmdTimeout=$SLURMD_TIMEOUT
# slurmd answers a kill of a step or job only once the step has ended: up to KillWait after
# the tasks' SIGTERM. An answer later than MessageTimeout makes slurmctld send the kill again
# 60 s later, by job and step id; with cred_expire=5 (above) the requeued job, same id, step 0
# again, already runs then, and that stale kill cancels it (every rank 143, job FAILED: the
# rescue test's CI flake). SLURM's own guard, the default cred_expire=120 holding a requeued
# job back 121 s, is what this cluster gives up; so the answer must always come in time.
MessageTimeout=$MSG_TIMEOUT
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
SchedulerParameters=batch_sched_delay=0,bf_interval=1,sched_interval=2
# Four CPUs per node whatever the machine has: 2-node jobs of 2 tasks fit on the small machines.
SlurmdParameters=config_overrides
EOF
        for ((k = 1; k <= NODES; k++)); do
            echo "NodeName=$(node_name "$k") NodeAddr=$(node_addr "$k")" \
                 "NodeHostname=$(node_name "$k") CPUs=4 State=UNKNOWN"
        done
        echo "PartitionName=mn Nodes=$nodes Default=YES MaxTime=INFINITE State=UP"
    } >"$tmp"
    changed=$(install_if_changed "$tmp" "$CONF")
    cgroup_conf_text >"$tmp"
    (( $(install_if_changed "$tmp" "$CONF_DIR/cgroup.conf") )) && changed=1
    rm -f "$tmp"
    echo "$changed"
}

install_if_changed() {
    if cmp -s "$1" "$2"; then
        echo 0
    else
        install -m 0644 "$1" "$2"
        echo 1
    fi
}

# ------------------------------------------------------------------------------ daemons

start_node() {
    local k=$1 name
    name=$(node_name "$k")
    alive "$(node_pidfile "$k")" && return 0
    mkdir -p "$BASE/spool/$name"
    # nsenter, not `ip netns exec`: that remounts /sys and hides the cgroup mounts slurmd needs.
    without_inherited_fds nsenter --net="/run/netns/$name" unshare --uts \
        sh -c "hostname $name && exec slurmd -f '$CONF' -N $name" \
        || die "slurmd of $name failed to start; see $LOGS/slurmd-$name.log"
}

# Nodes of an earlier, larger cluster (KR_MN_NODES was higher then) still on this machine.
extra_nodes() {
    local ns k
    for ns in /run/netns/"$PREFIX"*; do
        [[ -e $ns ]] || continue
        k=${ns##*/"$PREFIX"}
        [[ $k =~ ^[0-9]+$ ]] && (( k > NODES )) && echo "$k"
    done
    return 0
}

# A node no longer in the cluster: its processes, namespace and link gone.
remove_node() {
    kill_node_procs "$1" || true
    [[ -e /run/netns/$(node_name "$1") ]] && ip netns del "$(node_name "$1")"
    ip link del "$(host_veth "$1")" >/dev/null 2>&1 || true
}

# Every process in node K's network namespace: its slurmd, slurmstepd and the job's tasks.
node_pids() {
    local name
    name=$(node_name "$1")
    [[ -e /run/netns/$name ]] || return 0
    ip netns pids "$name" 2>/dev/null || true
}

# The node dies at once, as on a power loss: every process is stopped first, then killed. Killed
# one by one, the node's srun or slurmstepd could outlive its tasks by a moment and act on
# their deaths. The kills go deepest first (children before their parents): a stopped process
# whose parent dies first is in a newly orphaned process group, and the kernel then sends it
# SIGHUP and SIGCONT (POSIX). srun woken that way "forces job termination": it has every task
# of the step SIGKILLed, the other nodes' too, which no real power loss does.
kill_node_procs() {
    local k=$1 i pids
    for ((i = 0; i < 50; i++)); do
        pids=$(node_pids "$k")
        [[ -z $pids ]] && return 0
        # shellcheck disable=SC2086
        kill -STOP $pids 2>/dev/null || true
        # shellcheck disable=SC2086
        kill -KILL $(deepest_first $pids) 2>/dev/null || true
        sleep 0.1
    done
    log "node $(node_name "$k"): processes survived SIGKILL: $(node_pids "$k" | tr '\n' ' ')"
    return 1
}

# The given pids ordered by their depth in the process tree, deepest first.
deepest_first() {
    ps -e -o pid=,ppid= | awk -v want="$*" '
        { parent[$1] = $2 }
        END {
            n = split(want, w, " ")
            for (i = 1; i <= n; i++) {
                d = 0
                for (p = w[i]; (p in parent) && p > 1 && d < 1000; p = parent[p]) d++
                print d, w[i]
            }
        }' | sort -rn | awk '{ print $2 }'
}

node_state() {
    sinfo -h -n "$(node_name "$1")" -o '%T' 2>/dev/null | head -n1 || true
}

wait_nodes_idle() {
    local deadline=$((SECONDS + ${1:-30})) k st pending
    shift || true
    local which=("$@")
    (( ${#which[@]} )) || which=($(seq 1 "$NODES"))
    while (( SECONDS < deadline )); do
        pending=0
        for k in "${which[@]}"; do
            st=$(node_state "$k")
            case "$st" in
                idle|mixed|allocated|completing) ;;
                down*|drain*|fail*)
                    pending=1
                    # Left over from an earlier run or a killed node (ReturnToService=2 covers
                    # most): resume it.
                    scontrol update NodeName="$(node_name "$k")" State=RESUME >/dev/null 2>&1 \
                        || true ;;
                *) pending=1 ;;
            esac
        done
        (( pending )) || return 0
        sleep 0.2
    done
    die "nodes not idle after ${1:-30}s:" \
        "$(sinfo -h -N -o '%N=%T' 2>/dev/null | tr '\n' ' '); see $LOGS"
}

stop_daemons() {
    local k deadline pid
    if alive "$CTL_PID"; then
        # Shuts down slurmctld and every slurmd that answers.
        scontrol shutdown >/dev/null 2>&1 || true
    fi
    deadline=$((SECONDS + 20))
    while (( SECONDS < deadline )); do
        alive "$CTL_PID" && { sleep 0.2; continue; }
        for ((k = 1; k <= NODES; k++)); do
            alive "$(node_pidfile "$k")" && { sleep 0.2; continue 2; }
        done
        break
    done
    if alive "$CTL_PID"; then
        pid=$(cat "$CTL_PID")
        log "slurmctld $pid did not stop; sending SIGKILL"
        kill -9 "$pid" 2>/dev/null || true
    fi
}

# ------------------------------------------------------------------------------ commands

cmd_start() {
    [[ $(id -u) == 0 ]] || die "must run as root (namespaces, bridge, daemons, /etc/hosts)"
    command -v nsenter >/dev/null && command -v unshare >/dev/null && command -v ip >/dev/null \
        || die "needs nsenter, unshare (util-linux) and ip (iproute2)"
    local t0=$SECONDS changed k
    install_if_missing
    mkdir -p "$STATE" "$RUN" "$LOGS" "$BASE/spool"
    setup_bridge
    for ((k = 1; k <= NODES; k++)); do setup_node_net "$k"; done
    write_hosts
    changed=$(write_conf)
    start_munge
    # Shrunk (a test asked for more nodes before): the extra nodes go, as with `stop`.
    for k in $(extra_nodes); do remove_node "$k"; done
    if (( changed )); then
        local any=0
        alive "$CTL_PID" && any=1
        for ((k = 1; k <= NODES; k++)); do alive "$(node_pidfile "$k")" && any=1; done
        if (( any )); then
            # Daemons read AuthInfo (and most settings) only at start: restart them.
            log "configuration changed: restarting the daemons"
            stop_daemons
            for ((k = 1; k <= NODES; k++)); do kill_node_procs "$k" || true; done
        fi
    fi
    alive "$CTL_PID" || without_inherited_fds slurmctld -f "$CONF" \
        || die "slurmctld failed to start; see $LOGS/slurmctld.log"
    for ((k = 1; k <= NODES; k++)); do start_node "$k"; done
    wait_nodes_idle 60
    log "cluster up: $NODES nodes on $NET.0/24 ($((SECONDS - t0)) s, proctrack/$(proctrack));" \
        "export SLURM_CONF=$CONF"
}

cmd_stop() {
    local k ids deadline
    if alive "$CTL_PID"; then
        # `scontrol shutdown` leaves running jobs alive, and they come back at the next start.
        ids=$(squeue -h -o '%A' 2>/dev/null || true)
        if [[ -n $ids ]]; then
            # shellcheck disable=SC2086
            scancel $ids >/dev/null 2>&1 || true
        fi
        deadline=$((SECONDS + KILLWAIT + 20))
        while [[ -n $(squeue -h -o '%A' 2>/dev/null || true) ]] && (( SECONDS < deadline )); do
            sleep 0.3
        done
    fi
    stop_daemons
    # Whatever is left in a node (a job of a dead slurmd, a stuck daemon) dies with the node.
    for ((k = 1; k <= NODES; k++)); do kill_node_procs "$k" || true; done
    for ((k = 1; k <= NODES; k++)); do remove_node "$k"; done
    for k in $(extra_nodes); do remove_node "$k"; done
    ip link del "$BRIDGE" >/dev/null 2>&1 || true
    remove_hosts
    # Forget old jobs so the next start is clean (the logs stay for a post-mortem).
    rm -rf "${STATE:?}" "${BASE:?}/spool" "${RUN:?}"
    log "cluster stopped"
}

cmd_status() {
    local ok=0 k
    alive "$MUNGE_PID" && echo "munged: running" || { echo "munged: stopped"; ok=1; }
    alive "$CTL_PID" && echo "slurmctld: running" || { echo "slurmctld: stopped"; ok=1; }
    for ((k = 1; k <= NODES; k++)); do
        if alive "$(node_pidfile "$k")"; then
            echo "slurmd $(node_name "$k") ($(node_addr "$k")): running"
        else
            echo "slurmd $(node_name "$k") ($(node_addr "$k")): stopped"
            ok=1
        fi
    done
    if alive "$CTL_PID"; then
        sinfo -N 2>/dev/null || ok=1
        squeue 2>/dev/null || true
    fi
    return $ok
}

node_arg() {
    [[ ${1:-} =~ ^[0-9]+$ ]] && (( $1 >= 1 && $1 <= NODES )) \
        || die "give a node number 1..$NODES, e.g. kill-node 2"
}

case "${1:-}" in
    start) cmd_start ;;
    stop) cmd_stop ;;
    status) cmd_status ;;
    env) echo "export SLURM_CONF=$CONF" ;;
    kill-node)
        node_arg "${2:-}"
        kill_node_procs "$2"
        log "node $(node_name "$2"): every process killed (SIGKILL)" ;;
    restart-node)
        node_arg "${2:-}"
        setup_bridge
        setup_node_net "$2"
        start_node "$2"
        wait_nodes_idle 60 "$2"
        log "node $(node_name "$2"): slurmd running, node idle" ;;
    *) echo "usage: $0 start|stop|status|env|kill-node K|restart-node K" >&2; exit 2 ;;
esac
