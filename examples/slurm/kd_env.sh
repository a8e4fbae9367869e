# shellcheck shell=bash
# Shared by the sbatch scripts in this directory. Two uses:
#
#  1. Sourced by a batch script (`source kd_env.sh`): reads the job's shape from Slurm's own
#     variables -- nothing about nodes or tasks is written anywhere else -- and defines
#       KD_NODES          hostnames of the allocation (scontrol show hostnames), an array
#       KD_NNODES         SLURM_NNODES
#       KD_NTASKS         SLURM_NTASKS (every rank of the job)
#       KD_TASKS_PER_NODE KD_NTASKS / KD_NNODES (the scripts ask for an even spread)
#       KD_MASTER_ADDR    the first node's address (its NodeAddr): the rendezvous host
#       KD_MASTER_PORT    15000 + 8 x (job id mod 1875), unless set: the job owns the 8 ports from
#                         it (below Linux's ephemeral range); a job's steps use KD_MASTER_PORT + k
#       KD_LOG_DIR        where the JSON training log and per-step outputs go
#       KD_TASK           the per-task launcher: srun "${KD_TASK[@]}" python -m megatron_kd ...
#     and the helpers kd_read_args, kd_log and kd_run_step.
#
#  2. Run by srun for each task (`srun bash kd_env.sh CMD ARGS...`): exports torchrun's
#     variables for CMD and execs it:
#       RANK        = KD_RANK_OFFSET (default 0) + SLURM_PROCID
#       WORLD_SIZE  = KD_WORLD_SIZE (the whole job, exported by the batch script)
#       LOCAL_RANK  = KD_LOCAL_RANK_OFFSET (default 0) + SLURM_LOCALID
#       MASTER_ADDR, MASTER_PORT = KD_MASTER_ADDR, KD_MASTER_PORT
#     The offsets let two job steps (e.g. teacher ranks and student ranks) form one world.
#
# Settings (environment variables, all optional):
#   KD_USE_CPU=1         CPU only: hides GPUs (CUDA_VISIBLE_DEVICES=""), so the program uses gloo;
#                        one thread per rank unless OMP_NUM_THREADS is set. For tests and trials.
#   KD_PYTHON            the Python interpreter (default: python)
#   KD_MASTER_PORT       a fixed rendezvous port instead of the one derived from the job id; set it
#                        if a daemon on your nodes listens in 15000-30000 (the scripts also use
#                        the 7 ports after it: disaggregated.sbatch's teacher step, the replicas
#                        that teacher.sbatch puts on one node)
#   KD_LOG_DIR           default: $SLURM_SUBMIT_DIR/logs/$SLURM_JOB_NAME-$SLURM_JOB_ID
#   KD_NETWORK_ENV       a site file of network settings, sourced by every task (see below)

_kd_task_main() {
    : "${SLURM_PROCID:?kd_env.sh: run me under srun (SLURM_PROCID is not set)}"
    export RANK=$(( ${KD_RANK_OFFSET:-0} + SLURM_PROCID ))
    export WORLD_SIZE="${KD_WORLD_SIZE:-${SLURM_NTASKS:?}}"
    export LOCAL_RANK=$(( ${KD_LOCAL_RANK_OFFSET:-0} + ${SLURM_LOCALID:-0} ))
    export MASTER_ADDR="${KD_MASTER_ADDR:?kd_env.sh: KD_MASTER_ADDR not set (source me first)}"
    export MASTER_PORT="${KD_MASTER_PORT:?kd_env.sh: KD_MASTER_PORT not set (source me first)}"
    _kd_network_env
    exec "$@"
}

# ================================================================================================
# OPTIONAL: cluster-specific network settings. Nothing below is needed on a cluster whose NCCL
# defaults work; adapt it to your fabric or put it in a site file named by KD_NETWORK_ENV.
# Every task sources it just before the program starts.
# ================================================================================================
_kd_network_env() {
    if [ -n "${KD_NETWORK_ENV:-}" ]; then
        # shellcheck disable=SC1090
        source "$KD_NETWORK_ENV"
    fi
    # Examples (uncomment and adapt):
    # export NCCL_SOCKET_IFNAME=ib0            # interface for NCCL's bootstrap / socket traffic
    # export GLOO_SOCKET_IFNAME=ib0            # the same for gloo (CPU groups)
    # export NCCL_IB_HCA=mlx5_0,mlx5_1         # InfiniBand adapters to use
    # export NCCL_IB_GID_INDEX=3               # RoCE
    # export NCCL_NET_GDR_LEVEL=PHB            # GPUDirect RDMA
    # export NCCL_DEBUG=INFO                   # print the chosen transports once
    :
}
# ================================================================================ end of optional

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
    # Executed (srun bash kd_env.sh CMD...): one task.
    _kd_task_main "$@"
fi

# ---- sourced by a batch script ------------------------------------------------------------------
: "${SLURM_JOB_ID:?kd_env.sh: source me from a Slurm batch script}"

kd_log() { echo "megatron-kd[$SLURM_JOB_ID]: $*" >&2; }

# kd_node_addr NODE: the address Slurm reaches NODE at (its NodeAddr; the name if none is set).
kd_node_addr() {
    local addr
    addr="$(scontrol show node "$1" 2>/dev/null | sed -n 's/.*NodeAddr=\([^ ]*\).*/\1/p' \
        | head -n 1)"
    echo "${addr:-$1}"
}


mapfile -t KD_NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
KD_NNODES="$SLURM_NNODES"
KD_NTASKS="${SLURM_NTASKS:?kd_env.sh: SLURM_NTASKS is not set: submit with --ntasks-per-node}"
if [ "${#KD_NODES[@]}" -ne "$KD_NNODES" ]; then
    kd_log "SLURM_JOB_NODELIST ($SLURM_JOB_NODELIST) names ${#KD_NODES[@]} nodes," \
           "SLURM_NNODES says $KD_NNODES"
    exit 2
fi
if [ $(( KD_NTASKS % KD_NNODES )) -ne 0 ]; then
    kd_log "SLURM_NTASKS=$KD_NTASKS does not spread evenly over $KD_NNODES nodes:" \
           "submit with --ntasks-per-node"
    exit 2
fi
KD_TASKS_PER_NODE=$(( KD_NTASKS / KD_NNODES ))
# A job submitted from inside another one inherits that job's exported values: drop them.
if [ -n "${KD_ENV_JOB_ID:-}" ] && [ "$KD_ENV_JOB_ID" != "$SLURM_JOB_ID" ]; then
    unset KD_MASTER_ADDR KD_MASTER_PORT KD_WORLD_SIZE KD_LOG_DIR
fi
export KD_ENV_JOB_ID="$SLURM_JOB_ID"
KD_MASTER_ADDR="${KD_MASTER_ADDR:-$(kd_node_addr "${KD_NODES[0]}")}"
# Derived from the job id, so that two jobs sharing a node do not collide: 8 ports a job.
KD_PORTS_PER_JOB=8
KD_MASTER_PORT="${KD_MASTER_PORT:-$(( 15000 + KD_PORTS_PER_JOB * (SLURM_JOB_ID % 1875) ))}"
KD_WORLD_SIZE="$KD_NTASKS"
KD_LOG_DIR="${KD_LOG_DIR:-${SLURM_SUBMIT_DIR:-$PWD}/logs/${SLURM_JOB_NAME:-job}-$SLURM_JOB_ID}"
KD_PYTHON="${KD_PYTHON:-python}"
export KD_MASTER_ADDR KD_MASTER_PORT KD_WORLD_SIZE KD_LOG_DIR KD_PYTHON
mkdir -p "$KD_LOG_DIR"

if [ "${KD_USE_CPU:-0}" = 1 ]; then
    export CUDA_VISIBLE_DEVICES=""
    export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
fi

# The per-task launcher; this file's own path (Slurm runs a copy of the batch script, but this
# file is sourced from where it lies).
KD_ENV_SH="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/$(basename "${BASH_SOURCE[0]}")"
KD_TASK=(bash "$KD_ENV_SH")

# kd_read_args ARRAY FILE: fill ARRAY with the whitespace-separated words of FILE; '#' starts a
# comment. No shell quoting or expansion (paths with spaces are not supported).
kd_read_args() {
    local -n _out="$1"
    local line words
    [ -r "$2" ] || { kd_log "cannot read arguments file $2"; return 2; }
    _out=()
    while IFS= read -r line || [ -n "$line" ]; do
        line="${line%%#*}"
        read -r -a words <<< "$line"
        _out+=("${words[@]}")
    done < "$2"
}

# kd_run_step NAME SRUN_OPTIONS... -- CMD...: one job step, its output in $KD_LOG_DIR/NAME.log
# (each line prefixed by the step's task id); runs in the background, sets KD_STEP_PID.
kd_run_step() {
    local name="$1"; shift
    local opts=()
    while [ "$#" -gt 0 ] && [ "$1" != "--" ]; do opts+=("$1"); shift; done
    shift
    srun --label --job-name="$name" --output="$KD_LOG_DIR/$name.log" \
        "${opts[@]}" "${KD_TASK[@]}" "$@" &
    # shellcheck disable=SC2034  # read by the caller
    KD_STEP_PID=$!
}

# kd_stop_step NAME: SIGTERM to every task of this job's step NAME (a service stops cleanly;
# signalling srun itself would cancel the step with SIGKILL).
kd_stop_step() {
    local step
    step="$(squeue --steps --jobs "$SLURM_JOB_ID" --noheader --format="%i %j" 2>/dev/null \
        | awk -v n="$1" '$2 == n {print $1; exit}')"
    if [ -n "$step" ]; then
        scancel --signal=TERM "$step"
    else
        kd_log "no running step named $1"
    fi
}

# kd_last_value FLAG ARGS...: the value of the last FLAG in ARGS (what argparse takes), or
# nothing.
kd_last_value() {
    local flag="$1" value="" prev=""
    shift
    for arg in "$@"; do
        [ "$prev" = "$flag" ] && value="$arg"
        prev="$arg"
    done
    printf '%s' "$value"
}

# kd_requeue_if_stopped JSONL: a long run's next job. When the training run's JSON log ends with
# a resumable exit record -- the run stopped at a SIGTERM (--exit-signal-handler: the time
# limit's --signal, scancel --signal=TERM) or at --exit-duration-in-mins, and saved -- requeue
# this job: Slurm starts it again (same job id, same flags, after its requeue delay) and the run
# resumes from --load. A run that reached --train-iters, or failed, is not requeued. KD_REQUEUE=0
# turns this off (resubmit by hand, or chain jobs with sbatch --dependency=afterok:JOBID).
kd_requeue_if_stopped() {
    local last
    [ "${KD_REQUEUE:-1}" = 1 ] || return 0
    [ -n "$1" ] && [ -r "$1" ] || return 0
    last="$(tail -n 1 "$1")"
    case "$last" in
        *'"event": "exit"'*'"resumable": true'*) ;;
        *) return 0 ;;
    esac
    kd_log "the run stopped before --train-iters and saved ($last):" \
           "requeueing job $SLURM_JOB_ID (restart $(( ${SLURM_RESTART_COUNT:-0} + 1 )))"
    if ! scontrol requeue "$SLURM_JOB_ID"; then
        kd_log "requeue refused (a job needs --requeue and a cluster with JobRequeue allowed):" \
               "submit the job again with the same --load to continue"
        return 3
    fi
    sleep 300  # Slurm ends this script as it requeues the job
}

kd_log "$KD_NNODES node(s) [${KD_NODES[*]}] x $KD_TASKS_PER_NODE task(s) = world $KD_WORLD_SIZE;" \
       "rendezvous $KD_MASTER_ADDR:$KD_MASTER_PORT; logs in $KD_LOG_DIR"
