"""Host time of the optimizer step over a model's shards: the Python and table work that
runs before the GPU can start, apart from the GPU's own time.

``python -m experiments.kernel_bench --host llama-1b`` builds rank 0's shards of the preset at
each world size, as in ``--model``, and times with the GPU idle (synchronised before each
call): finding the launch plan, ``SRAdamW.prepare_step()`` (the plan, the keys and scalars,
each launch's checks and table upload) and, on a CUDA device, ``SRAdamW.step()`` unprepared
and after ``prepare_step()``; and, per world size, one measured step of the trainer's update
sizes. Without CUDA it times the host work alone (Triton's interpreter: ``TRITON_INTERPRET=1``;
the launches are not run; the update sizes' arithmetic runs on the CPU).
"""

from __future__ import annotations

import os
import statistics
import time

import torch

# (m format, v format, stochastic): the whole-model bench's state sets
HOST_STATE_SETS = (
    ("fp32", "fp32", False),
    ("bf16", "bf16", True),
    ("fp8", "fp8", True),
    ("fp4_e2m1", "fp4_e2m2", True),
)


def host_time_rows(preset: str, repeats: int, worlds: tuple[int, ...] = (8, 1)) -> list[dict]:
    """One row per (world size, state set): shards, launches and host microseconds."""
    from experiments.kernel_bench.rows import median_host_us, model_shard_shapes
    from srtrain.optim import SRAdamW

    cuda = torch.cuda.is_available()
    if not cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(
            "without a CUDA device the host-time bench needs TRITON_INTERPRET=1 "
            "set in the environment (the launches are planned for Triton's "
            "interpreter and not run)"
        )
    device = "cuda" if cuda else "cpu"
    rows = []
    for world in worlds:
        shapes = model_shard_shapes(preset, world)
        for m_fmt, v_fmt, stochastic in HOST_STATE_SETS:
            # values never matter to the host work; on the GPU the steps run on them
            make = torch.randn if cuda else torch.empty
            params = [torch.nn.Parameter(make(s, device=device)) for s in shapes]
            for p in params:
                p.grad = make(p.shape, device=device)
            rounding = "stochastic" if stochastic else "nearest"
            opt = SRAdamW(
                params,
                lr=1e-4,
                weight_decay=0.1,
                m_format=m_fmt,
                v_format=v_fmt,
                m_rounding=rounding,
                v_rounding=rounding,
                backend="triton",
            )
            opt.count_health = False  # the ordinary step, as training runs it between log steps
            row = {
                "name": f"{preset} W={world} m {m_fmt} v {v_fmt} {'SR' if stochastic else 'NR'}",
                "world": world,
                "shards": len(shapes),
            }
            if cuda:
                opt.step()  # compiles, and settles each launch's program count
                opt.step()
                row["step_us"] = median_host_us(opt.step, repeats)

                def prepared_step(opt=opt):
                    opt.prepare_step()
                    torch.cuda.synchronize()
                    start = time.perf_counter()
                    opt.step()
                    return (time.perf_counter() - start) * 1e6

                row["step_after_prepare_us"] = statistics.median(
                    prepared_step() for _ in range(repeats)
                )
            opt.prepare_step()  # warm: the first plan builds what later steps reuse
            row["plan_us"] = median_host_us(opt._current_plan, repeats)
            row["prepare_step_us"] = median_host_us(opt.prepare_step, repeats)
            row["launches"] = len(opt._plan.launches)
            rows.append(row)
            del opt, params
            if cuda:
                torch.cuda.empty_cache()
        rows.append(update_sizes_row(preset, world, shapes, repeats, device))
    return rows


def update_sizes_row(preset: str, world: int, shapes: list, repeats: int, device: str) -> dict:
    """One measured step of the trainer's update sizes (``UpdateSizes.before_step``,
    ``after_step`` and ``take``) over FP32 parameters of ``shapes``: its host time on CUDA,
    and on a CPU its whole time (the arithmetic on the sampled rows included)."""
    from experiments.kernel_bench.rows import median_host_us
    from srtrain.optim.update_size import UpdateSizes

    params = [torch.zeros(s, device=device) for s in shapes]
    sizes = UpdateSizes(params, ["mlp"] * len(params), [0] * len(params), device)
    optimizer = torch.optim.SGD(params, lr=1e-3, weight_decay=0.1)

    def measured_step() -> None:
        sizes.before_step()
        sizes.after_step(1, sizes.hyperparameters(optimizer))
        sizes.take()

    measured_step()
    return {
        "name": f"{preset} W={world} update sizes, one measured step",
        "world": world,
        "shards": len(shapes),
        "update_sizes_us": median_host_us(measured_step, max(repeats // 5, 5)),
    }
