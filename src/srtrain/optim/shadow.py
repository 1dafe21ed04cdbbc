"""A sampled FP32 shadow of the stored Adam states, and how far the stored ones drift from it.

For a fixed sample of blocks (``block_size`` consecutive elements of a row; a 1-D
parameter's elements are rows of one) the optimizer keeps FP32 ``m`` and ``v`` beside
the stored ones, updated from the same gradients (``m_f = β1·m_f + (1-β1)·g``,
``v_f = β2·v_f + (1-β2)·g²``) and reset with them, so the difference measures rounding
alone. Blocks are numbered globally (``row · blocks_per_row + block``) and the sample
takes one block in each window of ``every`` consecutive numbers, at a position hashed
from the window's number: it depends on the parameter's full shape only, never on the
sharding, so a resharded or resumed run samples the same elements.

Each rank keeps its shadow in a tensor of a fixed :func:`capacity` (its sampled elements
first, zeros after), wrapped like the parameter (a DTensor sharded on dim 0), so DCP saves
and loads every rank's part: a resume at the same world size continues exactly. A shadow
saved at another world size or sample does not fit: the load restarts it from the loaded
stored states (:func:`srtrain.checkpoint.load`), so it then measures the drift since.

Compared per layer group at log steps (:func:`report`): ``rel_err`` ``‖s-f‖/‖f‖``,
``bias`` ``Σ(s-f)/Σ|f|`` of each state, and ``update_cosine``, the cosine between the
update ``m̂/(√v̂+ε)`` the stored states give and the one the shadow gives.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch
import torch.distributed as dist

from srtrain.numerics.formats import row_layout
from srtrain.numerics.rounding import mix32
from srtrain.param_groups import GROUPS

DEFAULT_SAMPLE = 1024
SAMPLE_SALT = 0x5AD0E5A1

# Columns of the per-parameter sums (float64): for m then v, Σ(s-f)², Σf², Σ(s-f), Σ|f|;
# then the updates' Σ u_s·u_f, Σ u_s², Σ u_f², and the element count.
SUM_COLUMNS = 12
METRICS = ("rel_err_m", "rel_err_v", "bias_m", "bias_v", "update_cosine")


def sampled_blocks(first_block: int, num_blocks: int, every: int) -> np.ndarray:
    """Global numbers of the sampled blocks among ``[first_block, first_block + num_blocks)``:
    in each window ``[k·every, (k+1)·every)`` the block ``k·every + hash(k) % every``."""
    if num_blocks <= 0 or every <= 0:
        return np.zeros(0, dtype=np.int64)
    end = first_block + num_blocks
    windows = np.arange(first_block // every, (end - 1) // every + 1, dtype=np.int64)
    picks = windows * every + mix32(windows ^ SAMPLE_SALT) % every
    return picks[(picks >= first_block) & (picks < end)]


def sampled_elements(
    shape: tuple[int, ...], first_row: int, local_rows: int, block_size: int, every: int
) -> np.ndarray:
    """Flat indices, within a shard of rows ``[first_row, first_row + local_rows)`` of a
    parameter of full ``shape``, of the elements of its sampled blocks (ascending)."""
    _, cols = row_layout(shape)
    per_row = -(-cols // block_size)
    blocks = sampled_blocks(first_row * per_row, local_rows * per_row, every)
    row, block = blocks // per_row - first_row, blocks % per_row
    start = row * cols + block * block_size
    width = np.minimum(block_size, cols - block * block_size)
    within = np.arange(block_size, dtype=np.int64)
    return (start[:, None] + within)[within < width[:, None]]


def capacity(shape: tuple[int, ...], shards: int, block_size: int, every: int) -> int:
    """Most sampled elements any of ``shards`` dim-0 shards (FSDP2's even chunks) can hold."""
    rows, cols = row_layout(shape)
    if rows == 0 or cols == 0:
        return 0
    dim0 = shape[0] if len(shape) else 1
    max_rows = -(-dim0 // shards) * (rows // dim0)
    per_row = -(-cols // block_size)
    return (-(-max_rows * per_row // every) + 1) * min(block_size, cols)


def compare(
    values: torch.Tensor, sizes: Sequence[int], corrections: Sequence[tuple[float, float, float]]
) -> torch.Tensor:
    """The :data:`SUM_COLUMNS` sums (float64) comparing each parameter's stored ``m``, ``v``
    with its shadow: ``values`` (float32 [4, total]) holds the stored m, the stored v, the
    shadow m and the shadow v of the parameters' sampled elements, ``sizes[i]`` of parameter
    ``i`` after those of the one before; ``corrections[i]`` is its ``(1/(1-β1^age_m),
    1/(1-β2^age_v), eps)``. Returns [parameters, SUM_COLUMNS], each column summed per
    parameter in element order, all parameters' elements at once."""
    device = values.device
    out = torch.zeros(len(sizes), SUM_COLUMNS, dtype=torch.float64, device=device)
    total = sum(sizes)
    if values.shape != (4, total) or len(corrections) != len(sizes):
        raise ValueError(
            f"shadow.compare: values of shape {tuple(values.shape)} and {len(corrections)} "
            f"corrections for {len(sizes)} parameters of {total} sampled elements"
        )
    if not total:
        return out
    lengths = torch.tensor(list(sizes), dtype=torch.int64).to(device, non_blocking=True)
    per_parameter = torch.tensor(corrections, dtype=torch.float64).to(device, non_blocking=True)
    per_element = per_parameter.repeat_interleave(lengths, dim=0, output_size=total)
    bc1, bc2, eps = per_element.unbind(1)
    m_s, v_s, m_f, v_f = values.double()
    columns = []
    for s, f in ((m_s, m_f), (v_s, v_f)):
        d = s - f
        columns += [d.square(), f.square(), d, f.abs()]
    u_s = m_s * bc1 / ((v_s * bc2).clamp(min=0).sqrt() + eps)
    u_f = m_f * bc1 / ((v_f * bc2).clamp(min=0).sqrt() + eps)
    columns += [u_s * u_f, u_s.square(), u_f.square()]
    for i, column in enumerate(columns):
        out[:, i] = torch.segment_reduce(column, "sum", lengths=lengths)
    out[:, -1] = lengths.double()
    return out


def bias_corrections(beta1: float, beta2: float, age_m: int, age_v: int) -> tuple[float, float]:
    """Adam's bias corrections ``1/(1-β^age)`` of states of these ages (1 at age 0: a state
    that is zero)."""
    return (
        1.0 / (1.0 - beta1**age_m) if age_m else 1.0,
        1.0 / (1.0 - beta2**age_v) if age_v else 1.0,
    )


def _ratio(num: float, den: float) -> float:
    if den > 0:
        return num / den
    return 0.0 if num == 0 else math.inf


def metrics_of(row: list[float]) -> dict[str, float]:
    """The :data:`METRICS` of one row of summed :func:`compare` columns."""
    m2, mf2, md, mf1, v2, vf2, vd, vf1, dot, us2, uf2, _ = row
    norms = us2 * uf2
    cosine = dot / math.sqrt(norms) if norms > 0 else (1.0 if us2 == uf2 else 0.0)
    return {
        "rel_err_m": math.sqrt(_ratio(m2, mf2)),
        "rel_err_v": math.sqrt(_ratio(v2, vf2)),
        "bias_m": _ratio(md, mf1),
        "bias_v": _ratio(vd, vf1),
        "update_cosine": cosine,
    }


def report(
    sums: torch.Tensor, labels: list[str], group: dist.ProcessGroup | None = None
) -> dict[str, dict[str, float]]:
    """Per layer group (those with sampled elements) and over ``"all"``: :data:`METRICS` from
    per-parameter sums ``sums`` [P, SUM_COLUMNS] whose layer groups are ``labels``. Sums run
    over ``group``'s ranks (one model's shards); every rank of it must call."""
    if sums.shape != (len(labels), SUM_COLUMNS):
        raise ValueError(
            f"shadow.report: sums of shape {tuple(sums.shape)} for {len(labels)} parameters"
        )
    index = torch.tensor(
        [GROUPS.index(label) for label in labels], dtype=torch.int64, device=sums.device
    )
    per_group = torch.zeros(len(GROUPS), SUM_COLUMNS, dtype=torch.float64, device=sums.device)
    per_group.index_add_(0, index, sums.to(torch.float64))
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(per_group, group=group)
    rows = per_group.tolist()
    out = {name: metrics_of(row) for name, row in zip(GROUPS, rows, strict=True) if row[-1]}
    total = [sum(column) for column in zip(*rows, strict=True)]
    if total[-1]:
        out["all"] = metrics_of(total)
    return out
