# Shared by the launch scripts (sourced, not run): CPU threads per process and the torchrun
# command. Usage: source launch/common.sh PROCESSES_PER_NODE; then "${launcher[@]}" ...
#   OMP_NUM_THREADS  kept when set, else CPU cores / processes (at least 1)
#   TORCHRUN         launcher command (split on spaces); else "$PYTHON -m torch.distributed.run"
#                    when PYTHON is set; else torchrun

if [[ -z "${OMP_NUM_THREADS:-}" ]]; then
    OMP_NUM_THREADS=$(( $(nproc) / $1 ))
    (( OMP_NUM_THREADS >= 1 )) || OMP_NUM_THREADS=1
fi
export OMP_NUM_THREADS

if [[ -n "${TORCHRUN:-}" ]]; then
    read -r -a launcher <<< "$TORCHRUN"
elif [[ -n "${PYTHON:-}" ]]; then
    launcher=("$PYTHON" -m torch.distributed.run)
else
    launcher=(torchrun)
fi
