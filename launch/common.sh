# Shared by the launch scripts (sourced, not run): CPU threads per process and the torchrun
# command. Usage: source launch/common.sh PROCESSES_PER_NODE; then "${launcher[@]}" ...
#   OMP_NUM_THREADS  kept when set, else CPU cores / processes (at least 1)
#   TORCHRUN         launcher command (split on spaces); else launch/torchrun.py (torchrun,
#                    ending on SIGTERM or SIGINT with one line, not a traceback) run by
#                    $PYTHON, or python3 when PYTHON is not set
#   TORCH_ELASTIC_SHUTDOWN_TIMEOUT
#                    seconds torchrun gives its signalled workers to finish their step and
#                    save a checkpoint before it kills them (default 100; torchrun's own is 30)

if [[ -z "${OMP_NUM_THREADS:-}" ]]; then
    OMP_NUM_THREADS=$(( $(nproc) / $1 ))
    (( OMP_NUM_THREADS >= 1 )) || OMP_NUM_THREADS=1
fi
export OMP_NUM_THREADS
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT="${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-100}"

if [[ -n "${TORCHRUN:-}" ]]; then
    read -r -a launcher <<< "$TORCHRUN"
else
    launcher=("${PYTHON:-python3}" launch/torchrun.py)
fi
