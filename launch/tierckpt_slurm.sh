# shellcheck shell=bash
# Shared logic of launch/titan.sbatch and launch/mcore.sbatch (sourced, not run). See
# launch/README.md for the variables; every one has a default except the training command.
#
# Per allocation: a bounded retry loop. Each attempt is one `srun --kill-on-bad-exit=1` step
# with one torchrun per node (static rendezvous: node rank = SLURM_NODEID, master = first host
# of the allocation, a MASTER_PORT unique per job and attempt) and TIERCKPT_RESTART_COUNT =
# attempts this job launched before (all allocations), which the engine writes into the
# ledger's run_start. When the allocation has lost a node and TIERCKPT_MIN_NODES allows it,
# the next attempt runs on the remaining nodes (tck_shrink); otherwise, and when the retries
# are used up, the job is requeued (`scontrol requeue`, or exit TIERCKPT_REQUEUE_EXIT for a
# RequeueExit set by the admins), excluding the node(s) that failed when the partition has
# enough other nodes.

tck_log() { printf '[tierckpt %(%F %T)T] %s\n' -1 "$*" >&2; }
tck_die() { tck_log "error: $*"; exit 2; }

# The worker exit status in torchrun's failure summary ("Root Cause … exitcode : -9 (pid …)")
# of one node's stderr file; "-" when there is none. Negative: killed by that signal.
tck_root_cause() {
    awk '/Root Cause/ {r = 1}
         r && /exitcode/ { if (match($0, /: *-?[0-9]+/)) { s = substr($0, RSTART, RLENGTH); gsub(/[^-0-9]/, "", s); print s; found = 1 }
                           exit }
         END { if (!found) print "-" }' "$1" 2>/dev/null || echo -
}

# Nodes whose worker died from a signal other than SIGTERM/SIGINT in one attempt (a crash, the
# OOM killer, a kill), from the node wrappers' files. The stderr copy is read, not the exit
# record, since a node failing at the same moment as another may be killed before writing it.
tck_blamed_nodes() {
    local f code out=()
    for f in "$1"/node-*.err; do
        [ -e "$f" ] || continue
        code=$(tck_root_cause "$f")
        case "$code" in -2|-15) ;; -[0-9]*) out+=("$(cat "${f%.err}.host" 2>/dev/null)") ;; esac
    done
    echo "${out[*]}"
}

# Whether a worker exited with status 2, the trainers' status for an invalid configuration:
# retrying or requeueing cannot help.
tck_config_error() {
    local f
    for f in "$1"/node-*.err; do
        [ -e "$f" ] || continue
        [ "$(tck_root_cause "$f")" = 2 ] && return 0
    done
    return 1
}

# The hosts among "$@" that the current step runs on.
tck_in_step() {
    local h out=()
    for h in "$@"; do [[ " $TCK_STEP_HOSTS " == *" $h "* ]] && out+=("$h"); done
    echo "${out[*]}"
}

# Nodes of the allocation that Slurm no longer considers usable.
tck_unhealthy_nodes() {
    sinfo -h -N -n "$SLURM_JOB_NODELIST" -o '%N %t' 2>/dev/null |
        awk '$2 ~ /^(down|drain|drng|fail|failg|inval)/ || $2 ~ /\*$/ {print $1}' |
        sort -u | tr '\n' ' '
}

# The comma-joined union of a Slurm host list and more names.
tck_merge_hosts() {
    local old=$1; shift
    { [ -n "$old" ] && [ "$old" != "(null)" ] && scontrol show hostnames "$old"; printf '%s\n' "$@"; } |
        awk 'NF' | sort -u | paste -sd, -
}

# Exclude $* from the job if the partition keeps enough usable nodes; prints the new list.
tck_exclusion() {
    local cur want avail need part
    cur=$(scontrol show job "$SLURM_JOB_ID" 2>/dev/null | tr ' ' '\n' | sed -n 's/^ExcNodeList=//p' | head -1)
    want=$(tck_merge_hosts "$cur" "$@")
    part=${SLURM_JOB_PARTITION%%,*}
    need=${SLURM_JOB_NUM_NODES:-$SLURM_NNODES}
    avail=$(sinfo -h -N -p "$part" -o '%N %t' 2>/dev/null |
        awk -v ex=",$want," '$2 !~ /^(down|drain|drng|fail|failg|inval)/ && $2 !~ /\*$/ && index(ex, "," $1 ",") == 0 {print $1}' |
        sort -u | wc -l)
    if [ "$avail" -ge "$need" ]; then
        echo "$want"
    else
        tck_log "not excluding $*: partition $part would keep $avail usable nodes, the job needs $need"
    fi
}

# Requeue this job (never returns). Args: reason, nodes to exclude.
tck_requeue() {
    local reason=$1; shift
    local restarts=${SLURM_RESTART_COUNT:-0} exc=""
    if [ "$restarts" -ge "$TIERCKPT_MAX_REQUEUES" ]; then
        tck_log "giving up: $reason; the job was already requeued $restarts times (TIERCKPT_MAX_REQUEUES=$TIERCKPT_MAX_REQUEUES)"
        echo "$(date +%s) give-up restarts=$restarts reason=\"$reason\"" >> "$TIERCKPT_STATE_DIR/events"
        exit "${TCK_LAST_RC:-1}"
    fi
    case "$TIERCKPT_REQUEUE" in
        scontrol)
            [ $# -gt 0 ] && exc=$(tck_exclusion "$@")
            echo "$(date +%s) requeue mode=scontrol exclude=${exc:--} reason=\"$reason\"" >> "$TIERCKPT_STATE_DIR/events"
            tck_log "requeueing job $SLURM_JOB_ID ($reason)${exc:+, excluding $exc}"
            # Slurm signals this script once the job is requeued; the exclusion must still be
            # set, and a job's node list can only change while it is pending (it is now).
            trap '' TERM INT
            scontrol requeue "$SLURM_JOB_ID" || { tck_log "scontrol requeue failed"; exit "${TCK_LAST_RC:-1}"; }
            if [ -n "$exc" ]; then
                local i ok=""
                for i in 1 2 3 4 5 6 7 8 9 10; do
                    scontrol update "jobid=$SLURM_JOB_ID" "ExcNodeList=$exc" 2>/dev/null && { ok=1; break; }
                    sleep 0.2
                done
                [ -n "$ok" ] || tck_log "could not set ExcNodeList=$exc"
            fi
            exit 0 ;;
        exit)
            echo "$(date +%s) requeue mode=exit code=$TIERCKPT_REQUEUE_EXIT reason=\"$reason\"" >> "$TIERCKPT_STATE_DIR/events"
            tck_log "exiting with $TIERCKPT_REQUEUE_EXIT for RequeueExit ($reason); nodes cannot be excluded this way${*:+: $*}"
            exit "$TIERCKPT_REQUEUE_EXIT" ;;
        *)
            tck_log "not requeueing (TIERCKPT_REQUEUE=none): $reason"
            exit "${TCK_LAST_RC:-1}" ;;
    esac
}

# A preemption notice to the batch script: `#SBATCH --signal=B:USR1@<seconds>` before the time
# limit, PreemptParameters=send_user_signal, `scancel --batch --signal=USR1`, or the SIGTERM Slurm
# sends every process of the job before SIGKILL (scontrol requeue, preemption, time limit).
# The trap only records it and forwards SIGTERM to the training step (never to srun, which
# answers SIGTERM by SIGKILLing its step); the workers make their final save and exit, and the
# job is requeued instead of retried (tck_run). Args: the signal's name without "SIG".
TCK_NOTICE=""
TCK_CTL_PID=""  # TIERCKPT_AGENTS=warm: launch/slurm_agents.py while it runs (tck_forward_notice signals it)
tck_notice() {
    TCK_WOKE=1
    [ -n "$TCK_NOTICE" ] && return
    TCK_NOTICE=$1
    echo "$(date +%s) notice signal=SIG$1 attempt=${TCK_ATTEMPT:-0}" >> "$TIERCKPT_STATE_DIR/events"
    tck_log "SIG$1: preemption notice; the training step is asked to save and exit (SIGTERM)"
    tck_forward_notice
}

# SIGTERM to every step of the job but the batch step (scancel's default), i.e. to every process
# of the running attempt; torchrun forwards it to its workers. Not when Slurm is ending the job:
# it signals the steps itself, and scancel would retry ("try again later") until KillWait ends.
tck_forward_notice() {
    if [ -n "$TCK_NOTICE" ] && [ -n "$TCK_CTL_PID" ]; then  # warm: the agents forward it to the ranks
        kill -USR1 "$TCK_CTL_PID" 2>/dev/null
        return 0
    fi
    [ -n "$TCK_NOTICE" ] && [ -n "${TCK_SRUN_PID:-}" ] || return 0
    local state
    state=$(tck_job_state)
    if [ -n "$state" ] && [ "$state" != RUNNING ]; then
        tck_log "Slurm is ending the job (JobState=$state): it signals the training step itself"
        return 0
    fi
    timeout 10 scancel --signal=TERM "$SLURM_JOB_ID" 2>/dev/null ||
        tck_log "could not forward SIGTERM to the training step (scancel failed)"
}

tck_job_state() {
    scontrol show job "$SLURM_JOB_ID" 2>/dev/null | tr ' ' '\n' | sed -n 's/^JobState=//p' | head -1
}

# Why attempt directory $1 ended as a preemption, or nothing: a notice to this script
# ("SIGUSR1"), a worker that exited 75 after its final save ("exit-75": the training's status
# for "saved for a preemption, requeue me", e.g. `--signal=USR1@…` without B: reaching the
# workers directly), or a SIGTERM that reached every node of the step and not this script
# ("SIGTERM-to-step": preemption with GraceTime). A failed node takes the others down with a
# SIGTERM too, but its own record shows none.
tck_preemption() {
    local f n=0 t=0
    [ -n "$TCK_NOTICE" ] && { echo "SIG$TCK_NOTICE"; return; }
    for f in "$1"/node-*.err; do
        [ -e "$f" ] || continue
        [ "$(tck_root_cause "$f")" = 75 ] && { echo exit-75; return; }
    done
    for f in "$1"/node-*.exit; do
        [ -e "$f" ] || continue
        n=$((n + 1))
        [ "$(awk '{print $4}' "$f")" = TERM ] && t=$((t + 1))
    done
    [ "$n" -eq "$TCK_NNODES" ] && [ "$t" -eq "$n" ] && echo SIGTERM-to-step
    return 0
}

# Requeue after a preemption (never returns): no node is excluded and the retries of this
# allocation are not used; it counts against TIERCKPT_MAX_REQUEUES. When Slurm itself is ending
# the job (JobState no longer RUNNING: scontrol requeue, PreemptMode=REQUEUE, scancel, the time
# limit), Slurm decides what comes next. Args: why.
tck_requeue_preempted() {
    local state
    state=$(tck_job_state)
    if [ -n "$state" ] && [ "$state" != RUNNING ]; then
        echo "$(date +%s) slurm-ends state=$state reason=\"preempted ($1)\"" >> "$TIERCKPT_STATE_DIR/events"
        tck_log "preempted ($1): Slurm is ending this job itself (JobState=$state); not requeueing it here"
        exit "${TCK_LAST_RC:-1}"
    fi
    tck_requeue "preempted ($1)"
}

# MASTER_PORT for global attempt $1: unique per job (mod 1500 job ids) and per attempt (mod 8),
# in 20000..31999 (below Linux's ephemeral range); a port someone listens on is skipped.
tck_port() {
    local a=$1 p i
    p=$(( TIERCKPT_PORT_BASE + (SLURM_JOB_ID % 1500) * 8 + a % 8 ))
    for i in 0 1 2 3 4 5 6 7; do
        if [ "$(hostname -s)" = "${MASTER_ADDR%%.*}" ] && (exec 3<>"/dev/tcp/127.0.0.1/$p") 2>/dev/null; then
            p=$(( TIERCKPT_PORT_BASE + (SLURM_JOB_ID % 1500) * 8 + (a + i + 1) % 8 ))
            continue
        fi
        break
    done
    echo "$p"
}

# What runs on every node of an attempt (srun task): torchrun, its stderr also kept in a file,
# then an exit record (node id, host, torchrun status, "TERM" if the step got SIGTERM else "-").
# A SIGTERM to the step (a preemption notice forwarded by the batch script, Slurm's own before
# SIGKILL) reaches every process: torchrun forwards it to its workers, which make their final
# save; this bash and tee must outlive them, or the workers' stderr pipe breaks mid-save and the
# record is never written. SIGUSR1 (`--signal=USR1@…` without B:) is ignored here and so in
# torchrun, which would die of it; the workers install their own handler.
# On a step over part of the allocation (TCK_NODELIST, after a node was lost for good) the node
# rank is the host's position in that list, and a host whose rank changed since the previous
# attempt (TCK_PREV_HOSTS) takes its local root along: node-<old> becomes node-<new>, in node order.
# shellcheck disable=SC2016
TCK_NODE_SCRIPT='
host=${SLURMD_NODENAME:-$(hostname -s)}
rank=$SLURM_NODEID
if [ -n "${TCK_NODELIST:-}" ]; then
  rank=$(tr , "\n" <<< "$TCK_NODELIST" | grep -nxF "$host" | cut -d: -f1)
  rank=$((${rank:-0} - 1))
fi
sig=-
trap "sig=TERM" TERM
trap "" USR1
old=$(tr " " "\n" <<< "${TCK_PREV_HOSTS:-}" | grep -nxF "$host" | cut -d: -f1)
root=$TIERCKPT_LOCAL_ROOT
shared=
for h in "$root"/.hosts/*; do [ -e "$h" ] && [ "${h##*/}" != "$host" ] && shared=1; done
if [ -n "$old" ] && [ "$((old - 1))" -ne "$rank" ] && [ -n "$shared" ]; then
  # One local root seen by several hosts (nodes simulated on one machine): the renames form a chain
  # (node-2 -> node-1 while node-1 -> node-0), so wait until the host that held node-<rank> has
  # moved out, lest we find the name taken, or it takes the directory we just moved in; a lost
  # host leaves its directory behind, which is set aside. On a node-local root (only this host
  # in .hosts) nobody waits.
  holder=$(tr " " "\n" <<< "$TCK_PREV_HOSTS" | sed -n "$((rank + 1))p")
  if [ -n "$holder" ] && [ "$holder" != "$host" ]; then
    if tr , "\n" <<< "${TCK_NODELIST:-}" | grep -qxF "$holder"; then
      for _ in $(seq 600); do [ -e "$TCK_ATTEMPT_DIR/moved-$holder" ] && break; sleep 0.05; done
      [ -e "$TCK_ATTEMPT_DIR/moved-$holder" ] ||
        echo "[tierckpt] $host: $holder did not move out of node-$rank within 30 s" >&2
    elif [ -d "$root/node-$rank" ]; then
      mv "$root/node-$rank" "$root/.lost-$holder-$TIERCKPT_RESTART_COUNT" &&
        echo "[tierckpt] $host: node-$rank of lost host $holder set aside as .lost-$holder-$TIERCKPT_RESTART_COUNT" >&2
    fi
  fi
fi
if [ -n "$old" ] && [ "$((old - 1))" -ne "$rank" ] && [ -d "$root/node-$((old - 1))" ]; then
  if [ -e "$root/node-$rank" ]; then
    echo "[tierckpt] $host: node-$((old - 1)) not moved to node-$rank, which exists" >&2
  else
    mv "$root/node-$((old - 1))" "$root/node-$rank"
  fi
fi
: > "$TCK_ATTEMPT_DIR/moved-$host"
mkdir -p "$root/.hosts" 2>/dev/null && : > "$root/.hosts/$host" 2>/dev/null
f="$TCK_ATTEMPT_DIR/node-$rank"
echo "$host" > "$f.host"
# a pipeline, not a process substitution: bash waits for tee, so the file is complete
{ "$TIERCKPT_PYTHON" -m torch.distributed.run --nnodes="$TCK_NNODES" --node-rank="$rank" \
    --nproc-per-node="$TIERCKPT_NPROC_PER_NODE" --master-addr="$MASTER_ADDR" \
    --master-port="$MASTER_PORT" --max-restarts=0 --shutdown-timeout="$TIERCKPT_SHUTDOWN_TIMEOUT" \
    "$@" 2>&1 1>&3 3>&- | (trap "" TERM; exec tee "$f.err") >&2 3>&-
  rc=${PIPESTATUS[0]}; } 3>&1
trap "" TERM INT  # srun stops the step now: finish the record first
echo "$rank $(cat "$f.host") $rc $sig" > "$f.exit"
exit $rc
'

# Set every variable from the environment or its default. Args: job kind (titan|mcore).
tck_init() {
    [ -n "${SLURM_JOB_ID:-}" ] || tck_die "run inside a Slurm allocation: sbatch launch/$1.sbatch …"
    : "${TIERCKPT_HOME:=${SLURM_SUBMIT_DIR:-$PWD}}"
    if [ -z "${TIERCKPT_PYTHON:-}" ]; then
        if [ -x "$TIERCKPT_HOME/.venv/bin/python" ]; then TIERCKPT_PYTHON=$TIERCKPT_HOME/.venv/bin/python
        else TIERCKPT_PYTHON=python3; fi
    fi
    : "${TIERCKPT_NPROC_PER_NODE:=${SLURM_GPUS_ON_NODE:-1}}"
    : "${TIERCKPT_MAX_ATTEMPTS:=3}"
    : "${TIERCKPT_MAX_REQUEUES:=3}"
    : "${TIERCKPT_REQUEUE:=scontrol}"
    : "${TIERCKPT_REQUEUE_EXIT:=75}"
    : "${TIERCKPT_PORT_BASE:=20000}"
    : "${TIERCKPT_SHUTDOWN_TIMEOUT:=90}"
    if [ -z "${TIERCKPT_LOCAL_ROOT:-}" ]; then
        if [ -n "${SLURM_TMPDIR:-}" ]; then TIERCKPT_LOCAL_ROOT=$SLURM_TMPDIR/tierckpt
        else TIERCKPT_LOCAL_ROOT=/local_nvme/$SLURM_JOB_ID; fi
    fi
    : "${TIERCKPT_STATE_DIR:=${SLURM_SUBMIT_DIR:-$PWD}/.tierckpt/slurm-$SLURM_JOB_ID}"
    case "$TIERCKPT_REQUEUE" in scontrol|exit|none) ;; *)
        tck_die "TIERCKPT_REQUEUE=$TIERCKPT_REQUEUE: allowed values: scontrol, exit, none" ;; esac
    local v
    for v in TIERCKPT_NPROC_PER_NODE TIERCKPT_MAX_ATTEMPTS TIERCKPT_MAX_REQUEUES TIERCKPT_REQUEUE_EXIT TIERCKPT_PORT_BASE; do
        [[ "${!v}" =~ ^[0-9]+$ ]] || tck_die "$v=${!v}: must be a non-negative integer"
    done
    [ "$TIERCKPT_MAX_ATTEMPTS" -ge 1 ] || tck_die "TIERCKPT_MAX_ATTEMPTS must be >= 1"
    [[ "$TIERCKPT_SHUTDOWN_TIMEOUT" =~ ^[0-9]+$ ]] && [ "$TIERCKPT_SHUTDOWN_TIMEOUT" -ge 1 ] ||
        tck_die "TIERCKPT_SHUTDOWN_TIMEOUT=$TIERCKPT_SHUTDOWN_TIMEOUT: must be whole seconds >= 1 (more than preemption_grace_s plus one training step)"
    TCK_NNODES=${SLURM_JOB_NUM_NODES:-${SLURM_NNODES:-1}}
    : "${TIERCKPT_AGENTS:=torchrun}"
    : "${TIERCKPT_SPARES:=0}"
    : "${TIERCKPT_HANG_TIMEOUT:=10}"
    case "$TIERCKPT_AGENTS" in torchrun|warm) ;; *)
        tck_die "TIERCKPT_AGENTS=$TIERCKPT_AGENTS: allowed values: torchrun (one torchrun per node and attempt), warm (node agents that fork each attempt's ranks)" ;; esac
    [[ "$TIERCKPT_SPARES" =~ ^[0-9]+$ ]] && [ "$TIERCKPT_SPARES" -lt "$TCK_NNODES" ] ||
        tck_die "TIERCKPT_SPARES=$TIERCKPT_SPARES: must be an integer in 0..$((TCK_NNODES - 1)) (the allocation has $TCK_NNODES nodes)"
    [ "$TIERCKPT_SPARES" -eq 0 ] || [ "$TIERCKPT_AGENTS" = warm ] ||
        tck_die "TIERCKPT_SPARES=$TIERCKPT_SPARES needs TIERCKPT_AGENTS=warm (spares are idle node agents)"
    [[ "$TIERCKPT_HANG_TIMEOUT" =~ ^[0-9]+([.][0-9]+)?$ ]] ||
        tck_die "TIERCKPT_HANG_TIMEOUT=$TIERCKPT_HANG_TIMEOUT: must be seconds (0: off, else >= 2)"
    local train=$((TCK_NNODES - TIERCKPT_SPARES))
    : "${TIERCKPT_MIN_NODES:=$train}"
    [[ "$TIERCKPT_MIN_NODES" =~ ^[0-9]+$ ]] && [ "$TIERCKPT_MIN_NODES" -ge 1 ] && [ "$TIERCKPT_MIN_NODES" -le "$train" ] ||
        tck_die "TIERCKPT_MIN_NODES=$TIERCKPT_MIN_NODES: must be an integer in 1..$train (the allocation's $TCK_NNODES nodes less TIERCKPT_SPARES=$TIERCKPT_SPARES)"
    TCK_STEP_HOSTS=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | tr '\n' ' ')
    TCK_STEP_HOSTS=$(echo $TCK_STEP_HOSTS)  # one space between names, none around
    TCK_NODELIST=""
    TCK_PREV_HOSTS=""
    TCK_EXTRA=()
    MASTER_ADDR=${TCK_STEP_HOSTS%% *}
    [ -n "$MASTER_ADDR" ] || tck_die "cannot expand SLURM_JOB_NODELIST=$SLURM_JOB_NODELIST"
    mkdir -p "$TIERCKPT_STATE_DIR" || tck_die "TIERCKPT_STATE_DIR=$TIERCKPT_STATE_DIR cannot be created"
    # torchrun's --shutdown-timeout (the node script passes it), exported so the ranks' start-up
    # check sees what torchrun waits before SIGKILLing them after a notice
    export TIERCKPT_HOME TIERCKPT_PYTHON TIERCKPT_NPROC_PER_NODE TIERCKPT_LOCAL_ROOT TIERCKPT_STATE_DIR \
        TIERCKPT_SHUTDOWN_TIMEOUT TIERCKPT_AGENTS TIERCKPT_SPARES TCK_NNODES MASTER_ADDR TCK_NODELIST TCK_PREV_HOSTS
    export PYTHONPATH="$TIERCKPT_HOME${PYTHONPATH:+:$PYTHONPATH}"
}

# Go on with fewer nodes after Slurm reported node(s) of the last attempt unusable, when at
# least TIERCKPT_MIN_NODES are left and the job kind defines tck_reconfigure (titan.sbatch):
# the next attempt is a step on the remaining hosts, in allocation order, renumbered 0..N'-1,
# the master its first host, with tck_reconfigure's overrides for N' nodes appended (parallel
# degrees, replication J/F). The allocation must outlive the node: `sbatch --no-kill`.
# Returns 1 when it cannot (the caller requeues); exits 2 when the training configuration
# cannot fit the nodes left. Args: the unusable hosts (one word), then the training command.
tck_shrink() {
    local lost=" $1 " h left=() out
    shift
    for h in $TCK_STEP_HOSTS; do [[ "$lost" == *" $h "* ]] || left+=("$h"); done
    [ "${#left[@]}" -lt "$TCK_NNODES" ] || return 1  # none of this step's hosts was lost
    if [ "${#left[@]}" -lt "$TIERCKPT_MIN_NODES" ]; then
        tck_log "${#left[@]} usable nodes left, fewer than TIERCKPT_MIN_NODES=$TIERCKPT_MIN_NODES: not going on with fewer"
        return 1
    fi
    if ! declare -F tck_reconfigure >/dev/null; then
        tck_log "TIERCKPT_MIN_NODES: this job kind cannot go on with fewer nodes (no tck_reconfigure)"
        return 1
    fi
    if ! out=$(tck_reconfigure "${#left[@]}" "$@"); then
        echo "$(date +%s) give-up reason=\"cannot fit ${#left[@]} nodes\"" >> "$TIERCKPT_STATE_DIR/events"
        tck_log "the training configuration cannot go on with ${#left[@]} nodes (see above)"
        exit 2
    fi
    eval "TCK_EXTRA=($out)"  # shell words, quoted by the reconfigure step (shlex.join)
    TCK_STEP_HOSTS="${left[*]}"
    TCK_NODELIST=$(tr ' ' , <<< "$TCK_STEP_HOSTS")
    TCK_NNODES=${#left[@]}
    MASTER_ADDR=${left[0]}
    echo "$(date +%s) shrink nodes=$TCK_NNODES hosts=$TCK_NODELIST lost=$(echo $lost | tr ' ' ,) args=\"${TCK_EXTRA[*]}\"" >> "$TIERCKPT_STATE_DIR/events"
    tck_log "going on with $TCK_NNODES nodes ($TCK_NODELIST), master $MASTER_ADDR${TCK_EXTRA[*]:+, appending ${TCK_EXTRA[*]}}"
    return 0
}

# TIERCKPT_AGENTS=warm: one srun step of node agents for the whole allocation, driven by
# launch/slurm_agents.py on this host (attempts, spares, hang watch, shrink: see its docstring).
# Here only what needs the allocation: the notice trap, and the requeue once the agents give up
# (the hosts it blames excluded). Args: the training command.
tck_run_warm() {
    local rc blamed hosts ctl
    hosts=$(tr ' ' , <<< "$TCK_STEP_HOSTS")
    ctl=("$TIERCKPT_PYTHON" "$TIERCKPT_HOME/launch/slurm_agents.py" --hosts "$hosts" --spares "$TIERCKPT_SPARES"
         --state-dir "$TIERCKPT_STATE_DIR" --nproc-per-node "$TIERCKPT_NPROC_PER_NODE"
         --max-attempts "$TIERCKPT_MAX_ATTEMPTS" --min-nodes "$TIERCKPT_MIN_NODES"
         --local-root "$TIERCKPT_LOCAL_ROOT/node-{node}" --hang-timeout "$TIERCKPT_HANG_TIMEOUT"
         --notice-grace "$TIERCKPT_SHUTDOWN_TIMEOUT" -- "$@")
    if [ -n "${TIERCKPT_DRY_RUN:-}" ]; then
        printf '%q ' "${ctl[@]}"; echo
        exit 0
    fi
    tck_log "job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0}): warm node agents on $TCK_NNODES nodes ($SLURM_JOB_NODELIST), $TIERCKPT_SPARES spare(s), x $TIERCKPT_NPROC_PER_NODE ranks, local root $TIERCKPT_LOCAL_ROOT, state $TIERCKPT_STATE_DIR"
    TCK_ATTEMPT=warm
    trap 'tck_notice USR1' USR1
    trap 'tck_notice TERM' TERM
    [ -n "$TCK_NOTICE" ] && tck_requeue_preempted "SIG$TCK_NOTICE, before the agents started"
    "${ctl[@]}" &
    TCK_CTL_PID=$!
    while :; do
        TCK_WOKE=""
        wait "$TCK_CTL_PID"
        rc=$?
        [ -z "$TCK_WOKE" ] && break
    done
    TCK_CTL_PID=""
    TCK_LAST_RC=$rc
    case $rc in
        0) tck_log "training finished (warm agents)"; exit 0 ;;
        75) tck_requeue_preempted "${TCK_NOTICE:+SIG$TCK_NOTICE}${TCK_NOTICE:-exit-75}" ;;
        2) echo "$(date +%s) give-up reason=\"configuration error (worker exit status 2)\"" >> "$TIERCKPT_STATE_DIR/events"
           tck_log "a worker exited with status 2 (invalid configuration): not retrying"; exit 2 ;;
    esac
    blamed=$(cat "$TIERCKPT_STATE_DIR/warm-blamed" 2>/dev/null)
    # shellcheck disable=SC2086
    tck_requeue "the warm agents gave up in this allocation (exit $rc)" $blamed
}

# Run the training command ("$@": what follows torchrun's options, e.g. -m titan_plugin.train …)
# under the retry loop; exits with its status, or requeues.
tck_run() {
    [ "$TIERCKPT_AGENTS" = warm ] && tck_run_warm "$@"
    local attempt=0 counter rc blamed="" unhealthy b pre hosts_run=""
    counter=$TIERCKPT_STATE_DIR/attempts
    tck_log "job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0}): $TCK_NNODES nodes ($SLURM_JOB_NODELIST) x $TIERCKPT_NPROC_PER_NODE ranks, master $MASTER_ADDR, local root $TIERCKPT_LOCAL_ROOT, state $TIERCKPT_STATE_DIR"
    trap 'tck_notice USR1' USR1
    trap 'tck_notice TERM' TERM
    while :; do
        [ -n "$TCK_NOTICE" ] && tck_requeue_preempted "SIG$TCK_NOTICE, between attempts"
        attempt=$((attempt + 1))
        TCK_ATTEMPT=$attempt
        # attempts of this job in every allocation so far: the ledger's restart_count
        TIERCKPT_RESTART_COUNT=$(cat "$counter" 2>/dev/null || echo 0)
        [[ "$TIERCKPT_RESTART_COUNT" =~ ^[0-9]+$ ]] || TIERCKPT_RESTART_COUNT=0
        echo $((TIERCKPT_RESTART_COUNT + 1)) > "$counter.tmp" && mv -f "$counter.tmp" "$counter"
        MASTER_PORT=$(tck_port "$TIERCKPT_RESTART_COUNT")
        TCK_ATTEMPT_DIR=$TIERCKPT_STATE_DIR/attempt-$TIERCKPT_RESTART_COUNT
        mkdir -p "$TCK_ATTEMPT_DIR"
        export TIERCKPT_RESTART_COUNT MASTER_PORT TCK_ATTEMPT_DIR
        tck_log "attempt $attempt/$TIERCKPT_MAX_ATTEMPTS in this allocation (restart count $TIERCKPT_RESTART_COUNT), MASTER_PORT=$MASTER_PORT"
        TCK_PREV_HOSTS=$hosts_run  # the node script moves a renumbered host's local root along
        hosts_run=$TCK_STEP_HOSTS
        export TCK_NNODES MASTER_ADDR TCK_NODELIST TCK_PREV_HOSTS
        echo "$(date +%s) start attempt=$attempt restart_count=$TIERCKPT_RESTART_COUNT port=$MASTER_PORT nodes=${TCK_NODELIST:-$SLURM_JOB_NODELIST} slurm_restart=${SLURM_RESTART_COUNT:-0}" >> "$TIERCKPT_STATE_DIR/events"
        local step=(--kill-on-bad-exit=1 --nodes="$TCK_NNODES" --ntasks="$TCK_NNODES" --ntasks-per-node=1
                    ${TCK_NODELIST:+--nodelist="$TCK_NODELIST"})
        if [ -n "${TIERCKPT_DRY_RUN:-}" ]; then
            printf '%q ' srun "${step[@]}" bash -c "<node script>" tierckpt-node "$@" "${TCK_EXTRA[@]}"; echo
            printf 'node 0: '
            printf '%q ' "$TIERCKPT_PYTHON" -m torch.distributed.run --nnodes="$TCK_NNODES" --node-rank=0 \
                --nproc-per-node="$TIERCKPT_NPROC_PER_NODE" --master-addr="$MASTER_ADDR" --master-port="$MASTER_PORT" \
                --max-restarts=0 --shutdown-timeout="$TIERCKPT_SHUTDOWN_TIMEOUT" "$@" "${TCK_EXTRA[@]}"; echo
            exit 0
        fi
        # in the background: bash runs a trap only once the foreground command ends, and a
        # notice must reach the training while it runs; `wait` returns early for each one
        srun "${step[@]}" bash -c "$TCK_NODE_SCRIPT" tierckpt-node "$@" "${TCK_EXTRA[@]}" &
        TCK_SRUN_PID=$!
        tck_forward_notice
        while :; do
            TCK_WOKE=""
            wait "$TCK_SRUN_PID"
            rc=$?
            [ -z "$TCK_WOKE" ] && break
        done
        TCK_SRUN_PID=""
        TCK_LAST_RC=$rc
        if [ "$rc" -eq 0 ]; then
            echo "$(date +%s) end attempt=$attempt rc=0" >> "$TIERCKPT_STATE_DIR/events"
            tck_log "training finished (attempt $attempt)"
            exit 0
        fi
        pre=$(tck_preemption "$TCK_ATTEMPT_DIR")
        if [ -n "$pre" ]; then
            echo "$(date +%s) end attempt=$attempt rc=$rc preempted=$pre" >> "$TIERCKPT_STATE_DIR/events"
            tck_log "attempt $attempt ended on a preemption notice ($pre, srun exit $rc): not retried in this allocation"
            tck_requeue_preempted "$pre"
        fi
        b=$(tck_blamed_nodes "$TCK_ATTEMPT_DIR")
        blamed=$(echo "$blamed $b" | tr ' ' '\n' | awk 'NF' | sort -u | tr '\n' ' ')
        unhealthy=$(tck_in_step $(tck_unhealthy_nodes))  # a host lost before is no longer in the step
        b=$(echo $b)  # one space between names, none around
        unhealthy=$(echo $unhealthy)
        echo "$(date +%s) end attempt=$attempt rc=$rc failed_nodes=$(tr ' ' , <<< "${b:--}") unhealthy=$(tr ' ' , <<< "${unhealthy:--}")" >> "$TIERCKPT_STATE_DIR/events"
        tck_log "attempt $attempt failed (srun exit $rc)${b:+; worker killed by a signal on: $b}${unhealthy:+; unusable nodes: $unhealthy}"
        if tck_config_error "$TCK_ATTEMPT_DIR"; then
            echo "$(date +%s) give-up reason=\"configuration error (worker exit status 2)\"" >> "$TIERCKPT_STATE_DIR/events"
            tck_log "a worker exited with status 2 (invalid configuration): not retrying"
            exit 2
        fi
        if [ -n "$unhealthy" ] && [ "$attempt" -lt "$TIERCKPT_MAX_ATTEMPTS" ] && tck_shrink "$unhealthy" "$@"; then
            continue
        fi
        if [ -n "$unhealthy" ]; then
            # shellcheck disable=SC2086
            tck_requeue "the allocation lost node(s) $unhealthy" $unhealthy $blamed
        fi
        if [ "$attempt" -ge "$TIERCKPT_MAX_ATTEMPTS" ]; then
            # shellcheck disable=SC2086
            tck_requeue "$attempt attempts failed in this allocation" $blamed
        fi
    done
}
