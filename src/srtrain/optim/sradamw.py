"""SRAdamW: AdamW whose moments are stored in BF16/FP8/FP4 and rounded stochastically.

Works on plain tensors and on FSDP2 ``DTensor`` parameters, updating each rank's
local shards in one fused pass: on CUDA one Triton launch covers every shard that
shares dtypes, formats and rounding; elsewhere the PyTorch spec runs per shard. The
stochastic draws are keyed on (seed, step, parameter, state, global element
index), so results do not depend on how parameters are sharded. The launch plan is
kept while the same parameters have gradients; the step and state ages of its fused
shards are 0-d views into one CPU tensor, advanced together.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from srtrain.numerics.adamw import (
    NUM_COUNTS,
    AdamWScalars,
    RoundingPlan,
    adamw_step_reference,
    rewarmup_factor,
    shadow_moments_reference,
)
from srtrain.numerics.formats import (
    Format,
    check_block_size,
    check_moment_formats,
    code_dtype,
    code_shape,
    get_format,
    row_layout,
    scale_shape,
)
from srtrain.numerics.rounding import (
    STATE_MOMENTS,
    STATE_PARAM,
    StoredState,
    check_rounding,
    dequantize,
    empty_state,
    rng_key,
    rng_keys,
)
from srtrain.optim import shadow
from srtrain.optim.shards import LocalShards, local_shard

BACKENDS = ("auto", "triton", "torch")
STATES = ("m", "v")
COUNTERS = ("step", "m_age", "v_age")
# Group settings that the launch plan depends on; a change rebuilds it.
_PLAN_SETTINGS = (
    "backend",
    "m_format",
    "v_format",
    "block_size",
    "m_rounding",
    "v_rounding",
    "param_rounding",
    "seed",
)
_STORAGE_DTYPE = {torch.bfloat16: torch.int16, torch.float32: torch.int32}


def storage_dtype(fmt: Format) -> torch.dtype:
    """Integer dtype holding a format's codes in optimizer state (never cast on load)."""
    dtype = code_dtype(fmt)
    return _STORAGE_DTYPE.get(dtype, dtype)


def shard_offset(param: torch.Tensor) -> int:
    """Global flat index of the first element of this rank's shard of ``param``."""
    if not isinstance(param, DTensor):
        return 0
    for placement in param.placements:
        if not isinstance(placement, (Replicate, Shard)) or (
            isinstance(placement, Shard) and placement.dim != 0
        ):
            raise ValueError(
                "SRAdamW needs parameters sharded on dim 0 (FSDP2's default), "
                f"got {param.placements}"
            )
    _, offsets = compute_local_shape_and_global_offset(
        param.shape, param.device_mesh, param.placements
    )
    return offsets[0] * math.prod(param.shape[1:]) if param.ndim else 0


def _shard_count(param: torch.Tensor) -> int:
    """How many dim-0 shards ``param`` is split into (1 for a plain tensor)."""
    if not isinstance(param, DTensor):
        return 1
    return math.prod(
        param.device_mesh.size(i)
        for i, placement in enumerate(param.placements)
        if isinstance(placement, Shard)
    )


def _rows(values: list) -> dict[Any, slice | np.ndarray]:
    """The row numbers holding each distinct value: a slice where they are consecutive."""
    rows: dict[Any, list[int]] = {}
    for row, value in enumerate(values):
        rows.setdefault(value, []).append(row)
    return {
        value: slice(r[0], r[-1] + 1) if r[-1] - r[0] + 1 == len(r) else np.array(r)
        for value, r in rows.items()
    }


class StallCounts(NamedTuple):
    """What :meth:`SRAdamW.take_stall_counts` takes: the [P, NUM_COUNTS] int64 counts, the
    steps they cover, and how many of those steps counted the health counts (the columns
    from :data:`~srtrain.numerics.adamw.NUM_STALL_COUNTS` on; :attr:`SRAdamW.count_health`)."""

    counts: torch.Tensor
    steps: int
    health_steps: int


@dataclass
class _Entry:
    """A parameter with a gradient: its group, stream number and tensor."""

    group: int
    stream: int
    param: torch.Tensor


@dataclass
class _Launch:
    """A cached multi-tensor launch: its members and their rows among the fused shards."""

    step: Any  # srtrain.kernels.launch.MultiStep
    members: list[_Entry]
    streams: list[int]  # the members' stream numbers
    rows: slice | np.ndarray
    counts: torch.Tensor
    distributed: bool  # some member is a DTensor (its gradient's local shard is stepped)


@dataclass
class _Plan:
    """How steps run while the same parameters have gradients, the groups' plan settings stay
    and no state dict is loaded."""

    key: tuple  # which parameters have gradients, and each group's _PLAN_SETTINGS
    reference: list[_Entry]  # shards on the PyTorch spec path
    fused: list[_Entry]  # shards on the fused path, in parameter order (empty ones only count)
    counters: torch.Tensor  # [fused, 3] int64 (CPU): step, m age, v age; the states hold 0-d
    #                         views of its entries, so one in-place add advances them all
    streams: np.ndarray  # each fused shard's stream number (its index among all parameters)
    group_rows: dict[int, slice | np.ndarray]  # param group → its rows among the fused shards
    seed_rows: dict[int, slice | np.ndarray]  # seed → the rows of fused shards drawing with it
    launches: list[_Launch]
    shadow: _ShadowLaunch | None = None  # the fused path's shadow update, once built


@dataclass
class _ShadowLaunch:
    """The fused path's shadow: the update of each step and the read of each log step, the
    entries they serve (in their order, those with sampled elements), each entry's row among
    the fused shards, the groups' betas they were built with, and where each entry's
    gradient address is among those the launches stage (launch by launch, member by member)."""

    step: Any  # srtrain.kernels.shadow_update.ShadowUpdate, or None without sampled elements
    read: Any  # srtrain.kernels.sampled_states.SampledStates, or None likewise
    entries: list[_Entry]
    fused_rows: list[int]
    betas: tuple
    staged_rows: np.ndarray  # each entry's row among the launches' staged gradients, in order


@dataclass
class _Prepared:
    """A fused step whose host work is done (:meth:`SRAdamW.prepare_step`), with what it was
    computed from; the next step launches it only if none of that changed."""

    plan: _Plan
    grads: list[torch.Tensor | None]  # every parameter's gradient, as prepared
    settings: tuple  # each group's lr, betas, eps and weight decay
    counters: torch.Tensor  # the plan's counters before the step
    staged: list  # one srtrain.kernels.launch.StagedStep per launch

    def holds_for(self, plan: _Plan, grads: list[torch.Tensor | None], settings: tuple) -> bool:
        """Whether this step was prepared for ``plan`` with these gradient tensors, group
        settings and the plan's current counters."""
        return (
            self.plan is plan
            and self.settings == settings
            and all(a is b for a, b in zip(self.grads, grads, strict=True))
            and torch.equal(self.counters, plan.counters)
        )


class SRAdamW(LocalShards, torch.optim.Optimizer):
    """AdamW with low-precision, stochastically rounded moments and stall counting.

    Args beyond ``torch.optim.AdamW``'s: ``m_format``/``v_format`` (fp32, bf16,
    fp8, fp4_e2m1 for m, fp4_e2m2 for v), ``m_rounding``/``v_rounding``/
    ``param_rounding`` ("nearest" or "stochastic"; the last applies to BF16
    parameters), ``block_size`` of the scaled formats, ``seed`` of the draws,
    ``backend`` ("auto": Triton for CUDA tensors, the PyTorch spec elsewhere) and
    ``rewarmup``: after :meth:`reset`, the step size warms up again linearly over this many
    steps of the youngest reset state's age (0: the first update after a reset is at the
    full step size; see :func:`srtrain.numerics.adamw.rewarmup_factor`) and
    ``shadow_sample``: keep an FP32 shadow of ``m`` and ``v`` on one block in this many
    (0: none; see :mod:`srtrain.optim.shadow` and :meth:`shadow_sums`).

    Every step adds its stall counts to :attr:`stall_counts`. The health counts (underflow,
    saturation, scale changes) cost the fused step instructions on every element, so they
    are counted only on steps taken while :attr:`count_health` is set: a loop that reports
    them sets it True before the steps it reports and False after, and
    :meth:`take_stall_counts` says how many steps counted them (their fractions are over
    those steps). It is False from construction: the ordinary step counts the stall columns
    alone.
    """

    counts_stalls = True

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
        *,
        m_format: str = "bf16",
        v_format: str = "bf16",
        m_rounding: str = "stochastic",
        v_rounding: str = "stochastic",
        param_rounding: str = "stochastic",
        block_size: int = 32,
        seed: int = 0,
        backend: str = "auto",
        rewarmup: int = 20,
        shadow_sample: int = 0,
    ) -> None:
        if not lr >= 0.0:
            raise ValueError(f"lr must be >= 0, got {lr}")
        if not all(0.0 <= b < 1.0 for b in betas) or len(betas) != 2:
            raise ValueError(f"betas must be two values in [0, 1), got {betas}")
        if not eps >= 0.0:
            raise ValueError(f"eps must be >= 0, got {eps}")
        if not weight_decay >= 0.0:
            raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
        m_fmt, v_fmt = check_moment_formats(m_format, v_format)
        for name, mode in (
            ("m_rounding", m_rounding),
            ("v_rounding", v_rounding),
            ("param_rounding", param_rounding),
        ):
            try:
                check_rounding(mode)
            except ValueError as err:
                raise ValueError(f"{name}: {err}") from None
        check_block_size(block_size)
        if backend not in BACKENDS:
            raise ValueError(f"unknown backend {backend!r}; allowed: {', '.join(BACKENDS)}")
        if not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
        if not isinstance(rewarmup, int) or rewarmup < 0:
            raise ValueError(f"rewarmup must be a non-negative integer, got {rewarmup!r}")
        if not isinstance(shadow_sample, int) or shadow_sample < 0:
            raise ValueError(f"shadow_sample must be a non-negative integer, got {shadow_sample!r}")
        defaults = dict(
            lr=lr,
            betas=tuple(betas),
            eps=eps,
            weight_decay=weight_decay,
            m_format=m_fmt.name,
            v_format=v_fmt.name,
            m_rounding=m_rounding,
            v_rounding=v_rounding,
            param_rounding=param_rounding,
            block_size=block_size,
            seed=seed,
            backend=backend,
            rewarmup=rewarmup,
            shadow_sample=shadow_sample,
        )
        super().__init__(params, defaults)
        for p in self._params():
            if p.dtype not in (torch.float32, torch.bfloat16):
                raise TypeError(
                    f"SRAdamW updates float32 or bfloat16 parameters, got {p.dtype} "
                    f"(shape {tuple(p.shape)})"
                )
        self.count_health = False  # whether step() counts the health counts (class docstring)
        self._counts: torch.Tensor | None = None
        self._count_steps = 0
        self._health_steps = 0
        self._plan: _Plan | None = None
        # the plans of step_unit, by the streams of their units' parameters; a plan of all
        # parameters and unit plans never coexist (each binds its shards' counters)
        self._unit_plans: dict[tuple[int, ...], _Plan] = {}
        self._streams: dict[int, int] = {}  # id(parameter) → its stream number
        self._prepared: _Prepared | None = None
        # parameter → its sampled elements' local flat indices, the local rows holding them,
        # and their flat indices among those rows (see _shadow_index)
        self._shadow_indices: dict[
            torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]
        ] = {}

    def __setstate__(self, state: dict[str, Any]) -> None:
        """torch's, with the defaults of settings that a state dict saved before them lacks."""
        super().__setstate__(state)
        for group in self.param_groups:
            group.setdefault("rewarmup", 0)
            group.setdefault("shadow_sample", 0)

    # ------------------------------------------------------------------ bookkeeping

    def state_bytes(self) -> int:
        """Bytes of optimizer state held on this rank (codes and block scales)."""
        total = 0
        for state in self.state.values():
            for key, value in state.items():
                if key.endswith(("_codes", "_scales")):
                    local = local_shard(value)
                    total += local.numel() * local.element_size()
        return total

    def local_blocks(self) -> list[tuple[int, int]]:
        """Block-scale blocks of each parameter's local shard for m and v (0 for an unscaled
        format), in parameter order: what scale changes are counted over."""
        blocks = []
        for group in self.param_groups:
            for p in group["params"]:
                rows, cols = row_layout(tuple(local_shard(p).shape))
                per_row = -(-cols // group["block_size"])
                blocks.append(
                    tuple(
                        rows * per_row if get_format(group[f"{which}_format"]).scaled else 0
                        for which in STATES
                    )
                )
        return blocks

    def _counts_buffer(self, device: torch.device) -> torch.Tensor:
        if self._counts is None:
            self._counts = torch.zeros(
                len(self._params()), NUM_COUNTS, dtype=torch.int64, device=device
            )
        return self._counts

    @property
    def stall_counts(self) -> torch.Tensor | None:
        """Per-parameter [P, NUM_COUNTS] int64 counts (the ``COUNT_*`` columns of
        :mod:`srtrain.numerics.adamw`: m stalled, v stalled, param changed, non-finite grad,
        then the health counts: underflow, saturated and scales changed of m and v, of the
        steps that counted them) accumulated on the device since the last take."""
        return self._counts

    def take_stall_counts(self) -> StallCounts:
        """The accumulated counts, how many steps they cover and how many of those counted the
        health counts; restarts the count."""
        params = self._params()
        if self._counts is None:
            device = local_shard(params[0]).device if params else torch.device("cpu")
            self._counts_buffer(device)
        taken = self._counts.clone()
        self._counts.zero_()
        steps, self._count_steps = self._count_steps, 0
        health_steps, self._health_steps = self._health_steps, 0
        return StallCounts(taken, steps, health_steps)

    def _state_view(self, group: dict, p: torch.Tensor, which: str) -> StoredState:
        """The local shard of state ``which`` as a StoredState sharing its storage."""
        state = self.state[p]
        fmt = get_format(group[f"{which}_format"])
        codes = local_shard(state[f"{which}_codes"]).view(code_dtype(fmt))
        scales = local_shard(state[f"{which}_scales"]) if fmt.scaled else None
        return StoredState(fmt, codes, scales, tuple(local_shard(p).shape), group["block_size"])

    def init_state(self) -> None:
        """Create the zero state of every parameter that has none (e.g. before a load)."""
        for group in self.param_groups:
            for p in group["params"]:
                if not self.state[p]:
                    self._init_state(group, p)

    def _init_state(self, group: dict, p: torch.Tensor) -> None:
        state = self.state[p]
        local = local_shard(p)
        state["step"] = torch.zeros((), dtype=torch.int64)
        for which in STATES:
            fmt = get_format(group[f"{which}_format"])
            stored = empty_state(fmt, tuple(local.shape), group["block_size"], local.device)
            codes = stored.codes.view(storage_dtype(fmt))
            state[f"{which}_age"] = torch.zeros((), dtype=torch.int64)
            state[f"{which}_codes"] = self._like_param(p, codes, code_shape(fmt, p.shape))
            if fmt.scaled:
                full = scale_shape(tuple(p.shape), group["block_size"])
                state[f"{which}_scales"] = self._like_param(p, stored.scales, full)
        every = group["shadow_sample"]
        if every:
            shards = _shard_count(p)
            size = shadow.capacity(tuple(p.shape), shards, group["block_size"], every)
            for which in STATES:
                zeros = torch.zeros(size, dtype=torch.float32, device=local.device)
                state[f"shadow_{which}"] = self._like_param(p, zeros, (shards * size,))

    @staticmethod
    def _like_param(p: torch.Tensor, local: torch.Tensor, full_shape) -> torch.Tensor:
        """Wrap a local state tensor with the parameter's DTensor placement."""
        if not isinstance(p, DTensor):
            return local
        full_shape = torch.Size(full_shape)
        stride = [1] * len(full_shape)
        for i in range(len(full_shape) - 2, -1, -1):
            stride[i] = stride[i + 1] * full_shape[i + 1]
        return DTensor.from_local(
            local,
            p.device_mesh,
            p.placements,
            run_check=False,
            shape=full_shape,
            stride=tuple(stride),
        )

    # ----------------------------------------------------------------------- resets

    def reset(self, which: str = "both") -> None:
        """Set state ``"m"``, ``"v"`` or ``"both"`` to zero and its age to 0."""
        if which not in ("m", "v", "both"):
            raise ValueError(f"reset takes 'm', 'v' or 'both', got {which!r}")
        states = STATES if which == "both" else (which,)
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state.get(p)
                if not state:
                    continue
                for s in states:
                    fmt = get_format(group[f"{s}_format"])
                    local_shard(state[f"{s}_codes"]).zero_()
                    if fmt.scaled:
                        local_shard(state[f"{s}_scales"]).fill_(127 + fmt.min_scale_exp)
                    state[f"{s}_age"].zero_()
                    if f"shadow_{s}" in state:
                        local_shard(state[f"shadow_{s}"]).zero_()

    # ------------------------------------------------------------------------- step

    def _use_triton(self, group: dict, device: torch.device) -> bool:
        backend = group["backend"]
        if backend == "torch":
            return False
        if backend == "auto":
            return device.type == "cuda"
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError(
                "backend='triton' on a CPU tensor needs TRITON_INTERPRET=1 set before Triton "
                "is imported; use backend='torch' (or 'auto') on CPU"
            )
        return True

    def _current_plan(self) -> tuple[_Plan, list[torch.Tensor | None]]:
        """The launch plan for the gradients now set (rebuilt if they or a group's plan
        settings changed), and every parameter's gradient."""
        grads = [p.grad for g in self.param_groups for p in g["params"]]
        key = (
            [g is not None for g in grads],
            tuple(tuple(g[k] for k in _PLAN_SETTINGS) for g in self.param_groups),
        )
        plan = self._plan if self._plan is not None and self._plan.key == key else self._replan(key)
        return plan, grads

    def _settings(self) -> tuple:
        return tuple(
            (g["lr"], tuple(g["betas"]), g["eps"], g["weight_decay"], g["rewarmup"])
            for g in self.param_groups
        )

    @torch.no_grad()
    def prepare_step(self) -> None:
        """Do the host work of the next :meth:`step` now: its keys and scalars, and its
        launch tables queued for upload behind the work already on the stream.

        A training loop that next waits for the GPU (to check the gradient norm, say) overlaps
        this work with the backward pass. The next step launches what was prepared if the
        gradients (the same tensors, not modified after this call), hyperparameters and
        counters are unchanged, and prepares afresh otherwise; without a step it is dropped.
        """
        plan, grads = self._current_plan()
        self._prepared = None
        if plan.fused:
            staged = self._stage(plan, grads, (plan.counters + 1).numpy())
            self._prepared = _Prepared(plan, grads, self._settings(), plan.counters.clone(), staged)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """torch's zero_grad; a prepared step is dropped with the gradients it points at."""
        self._prepared = None
        super().zero_grad(set_to_none)

    @torch.no_grad()
    def step(self, closure=None):
        """Take one optimization step on every parameter with a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        plan, grads = self._current_plan()
        prepared, self._prepared = self._prepared, None
        health = bool(self.count_health)
        for e in plan.reference:
            self._step_reference(self.param_groups[e.group], e.param, e.stream, health)
        staged = []
        if plan.fused:
            fresh = prepared is None or not prepared.holds_for(plan, grads, self._settings())
            # a gradient the launches refuse leaves the counters as they were
            staged = (
                self._stage(plan, grads, (plan.counters + 1).numpy()) if fresh else prepared.staged
            )
            plan.counters += 1
            for launch, launch_staged in zip(plan.launches, staged, strict=True):
                launch.step.run(launch_staged, launch.counts, health)
        if plan.reference or plan.fused:
            self._count_steps += 1
            self._health_steps += health
        self._shadow_step(plan, staged)
        return loss

    @torch.no_grad()
    def step_unit(self, params: Iterable[torch.Tensor], gate: torch.Tensor | None = None) -> None:
        """Update those of ``params`` that have a gradient now (one FSDP2 unit, stepped inside
        backward as soon as its gradients are reduce-scattered); :meth:`end_unit_steps` ends
        the step once every unit has been stepped.

        ``gate`` (a 0-d float32 tensor on the parameters' device, read on the device without a
        host sync): a finite gate multiplies every gradient element in float32 (a clipping
        coefficient); a non-finite one leaves the unit's parameters, states and counts as they
        were. Either way the unit's step and state ages advance here; those of a unit the gate
        skipped go back in :meth:`end_unit_steps`. With the gate 1.0 (or None) the result is
        bit for bit that of :meth:`step` over the same gradients, whatever the units."""
        streams = self._streams_of(params)
        plan, grads = self._unit_plan(streams)
        health = bool(self.count_health)
        for e in plan.reference:
            self._step_reference(self.param_groups[e.group], e.param, e.stream, health, gate)
        staged = []
        if plan.fused:
            staged = self._stage(plan, grads, (plan.counters + 1).numpy(), gate)
            plan.counters += 1
            for launch, launch_staged in zip(plan.launches, staged, strict=True):
                launch.step.run(launch_staged, launch.counts, health)
        self._shadow_step(plan, staged, gate)

    def end_unit_steps(self, skipped: Iterable[Iterable[torch.Tensor]] = ()) -> None:
        """End a step taken by :meth:`step_unit`: the units in ``skipped`` (those whose gate
        was not finite) get their step and state ages back, as if they had not been stepped,
        and the step is counted for :meth:`take_stall_counts`."""
        for params in skipped:
            plan = self._unit_plans.get(self._streams_of(params))
            if plan is None:
                raise ValueError("end_unit_steps: a unit that step_unit has not stepped")
            for e in (*plan.reference, *plan.fused):
                state = self.state[e.param]
                for key in COUNTERS:
                    state[key] -= 1
        self._count_steps += 1
        self._health_steps += bool(self.count_health)

    def _streams_of(self, params: Iterable[torch.Tensor]) -> tuple[int, ...]:
        """The stream numbers (indices among all parameters) of ``params``, in order."""
        if len(self._streams) != len(self._params()):
            self._streams = {id(p): i for i, p in enumerate(self._params())}
        try:
            return tuple(self._streams[id(p)] for p in params)
        except KeyError:
            raise ValueError("step_unit: a parameter this optimizer does not hold") from None

    def _unit_plan(self, streams: tuple[int, ...]) -> tuple[_Plan, dict[int, torch.Tensor | None]]:
        """The launch plan of the parameters numbered ``streams`` (rebuilt if which of them
        have gradients, or a group's plan settings, changed), and their gradients by stream."""
        params = self._params()
        grads = {i: params[i].grad for i in streams}
        key = (
            [grads[i] is not None for i in streams],
            tuple(tuple(g[k] for k in _PLAN_SETTINGS) for g in self.param_groups),
        )
        plan = self._unit_plans.get(streams)
        if plan is None or plan.key != key:
            plan = self._replan(key, streams)
        return plan, grads

    # ----------------------------------------------------------------------- shadow

    def _shadow_index(
        self, group: dict, p: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The sampled elements of ``p``'s local shard: their flat indices, the local rows
        holding them, and their flat indices within those rows (cached)."""
        cached = self._shadow_indices.get(p)
        if cached is None:
            local = local_shard(p)
            _, cols = row_layout(tuple(p.shape))
            rows = local.numel() // cols if cols else 0
            elements = shadow.sampled_elements(
                tuple(p.shape),
                shard_offset(p) // max(cols, 1),
                rows,
                group["block_size"],
                group["shadow_sample"],
            )
            held, position = np.unique(elements // cols, return_inverse=True)
            within = position.reshape(-1) * cols + elements % cols
            cached = tuple(
                torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)).to(local.device)
                for a in (elements, held, within)
            )
            self._shadow_indices[p] = cached
        return cached

    def _shadow_step(self, plan: _Plan, staged: list, gate: torch.Tensor | None = None) -> None:
        """Advance the FP32 shadow of each stepped parameter's sampled elements with its
        gradient (:func:`~srtrain.numerics.adamw.shadow_moments_reference`): the fused path's
        in one launch (:class:`~srtrain.kernels.shadow_update.ShadowUpdate`) over the
        gradients ``staged`` for the plan's launches (checked and contiguous there), the spec
        path's batched per parameter group; ``gate`` as :meth:`step_unit` takes it."""
        by_group: dict[int, tuple[list, list, list]] = {}
        for e in plan.reference:
            sampled = self._sampled(e)
            if sampled is not None:
                elements, m_f, v_f = sampled
                grads, ms, vs = by_group.setdefault(e.group, ([], [], []))
                grads.append(local_shard(e.param.grad).reshape(-1).index_select(0, elements))
                ms.append(m_f)
                vs.append(v_f)
        gated = {} if gate is None else {"grad_scale": gate}
        for index, (grads, ms, vs) in by_group.items():
            shadow_moments_reference(grads, ms, vs, *self.param_groups[index]["betas"], **gated)
        if plan.fused:
            update = self._shadow_update(plan)
            if update is not None:
                addresses = (
                    staged[0].addresses
                    if len(staged) == 1
                    else np.concatenate([s.addresses for s in staged])
                )
                update.step.run(addresses[update.staged_rows], gate)

    def _sampled(self, e: _Entry) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """An entry's sampled local flat indices and the first elements of its shadow m and v
        holding them; None without a shadow or a sampled element."""
        group = self.param_groups[e.group]
        if not group["shadow_sample"]:
            return None
        elements = self._shadow_index(group, e.param)[0]
        n = elements.numel()
        if not n:
            return None
        state = self.state[e.param]
        return elements, local_shard(state["shadow_m"])[:n], local_shard(state["shadow_v"])[:n]

    def _shadow_update(self, plan: _Plan) -> _ShadowLaunch | None:
        """The plan's shadow launches of the fused path (built on first use, and again when a
        group's betas change); None when no fused parameter keeps a sampled element."""
        betas = tuple(tuple(g["betas"]) for g in self.param_groups)
        if plan.shadow is None or plan.shadow.betas != betas:
            from srtrain.kernels.sampled_states import SampledRead, SampledStates
            from srtrain.kernels.shadow_update import ShadowUpdate

            members = [
                (row, e, s)
                for row, e in enumerate(plan.fused)
                if (s := self._sampled(e)) is not None
            ]
            # each fused row's place among the staged gradients, and its gradient dtype
            staged_row = np.full(len(plan.fused), -1, dtype=np.int64)
            grad_dtype: list[torch.dtype | None] = [None] * len(plan.fused)
            first = 0
            for launch in plan.launches:
                rows = np.arange(len(plan.fused))[launch.rows]
                staged_row[rows] = np.arange(first, first + len(rows))
                first += len(rows)
                for row in rows:
                    grad_dtype[row] = launch.step.grad_dtype
            step = read = None
            if members:
                elements, ms, vs = ([s[i] for *_, s in members] for i in range(3))
                groups = [self.param_groups[e.group] for _, e, _ in members]
                step = ShadowUpdate(
                    elements,
                    ms,
                    vs,
                    [g["betas"] for g in groups],
                    [grad_dtype[row] for row, *_ in members],
                )
                read = SampledStates(
                    [
                        SampledRead(
                            index,
                            *(self._state_view(group, e.param, which) for which in STATES),
                            m,
                            v,
                        )
                        for (_, e, _), group, index, m, v in zip(
                            members, groups, elements, ms, vs, strict=True
                        )
                    ]
                )
            entries = [e for _, e, _ in members]
            rows = [row for row, *_ in members]
            plan.shadow = _ShadowLaunch(step, read, entries, rows, betas, staged_row[rows])
        return plan.shadow if plan.shadow.step is not None else None

    def _sampled_stored(self, group: dict, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The stored m and v of ``p``'s sampled local elements, dequantized (float32)."""
        return self._sampled_stored_many([(group, p)])[0]

    def _sampled_stored_many(
        self, items: list[tuple[dict, torch.Tensor]]
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The stored m and v of each (group, parameter)'s sampled local elements, dequantized
        (float32) by the spec: the rows holding them are gathered, and each kind of row
        (format, block size, row length) is dequantized once over every parameter's rows;
        rows dequantize independently, so each parameter gets the bits of its own rows'
        dequantization."""
        batches: dict[tuple, list[tuple[int, int, torch.Tensor, torch.Tensor | None]]] = {}
        withins = []
        for i, (group, p) in enumerate(items):
            _, held, within = self._shadow_index(group, p)
            withins.append(within)
            _, cols = row_layout(tuple(p.shape))
            rows = local_shard(p).numel() // cols
            for which in STATES:
                view = self._state_view(group, p, which)
                codes = view.codes.reshape(rows, -1).index_select(0, held)
                scales = (
                    view.scales.reshape(rows, -1).index_select(0, held)
                    if view.scales is not None
                    else None
                )
                key = (
                    view.fmt,
                    view.block_size,
                    cols,
                    codes.shape[1],
                    codes.dtype,
                    None if scales is None else scales.shape[1],
                    codes.device,
                )
                batches.setdefault(key, []).append((i, STATES.index(which), codes, scales))
        out: list[list[torch.Tensor | None]] = [[None, None] for _ in items]
        for (fmt, block_size, cols, *_), members in batches.items():
            codes = torch.cat([c for _, _, c, _ in members])
            scales = None if members[0][3] is None else torch.cat([s for *_, s in members])
            sub = StoredState(fmt, codes, scales, (codes.shape[0], cols), block_size)
            values = dequantize(sub).reshape(codes.shape[0], cols)
            parts = values.split([c.shape[0] for _, _, c, _ in members])
            for (i, state, _, _), part in zip(members, parts, strict=True):
                out[i][state] = part.reshape(-1).index_select(0, withins[i])
        return [(m, v) for m, v in out]

    @torch.no_grad()
    def shadow_sums(self) -> torch.Tensor | None:
        """Per parameter [P, :data:`srtrain.optim.shadow.SUM_COLUMNS`] float64 sums comparing
        the stored states of this rank's sampled elements with their FP32 shadow (zeros for a
        parameter without state); None when no group keeps a shadow. Reduce them with
        :func:`srtrain.optim.shadow.report`.

        The parameters the last fused step advanced are read by the plan's kernel
        (:class:`~srtrain.kernels.sampled_states.SampledStates`), the others by the spec."""
        if not any(g["shadow_sample"] for g in self.param_groups):
            return None
        params = self._params()
        device = local_shard(params[0]).device if params else torch.device("cpu")
        sums = torch.zeros(len(params), shadow.SUM_COLUMNS, dtype=torch.float64, device=device)
        read_by_kernel: set[int] = set()
        for plan in self._live_plans():
            launch = plan.shadow
            if launch is None or launch.read is None:
                continue
            ages = plan.counters[launch.fused_rows, 1:].tolist()
            corrections = [
                self._corrections(self.param_groups[e.group], *age)
                for e, age in zip(launch.entries, ages, strict=True)
            ]
            values = launch.read.read()
            rows = [e.stream for e in launch.entries]
            sums[rows] = shadow.compare(values, launch.read.sizes, corrections)
            read_by_kernel.update(rows)
        items: list[tuple[dict, torch.Tensor]] = []
        rows, shadows, corrections = [], [], []
        row = -1
        for group in self.param_groups:
            for p in group["params"]:
                row += 1
                state = self.state.get(p)
                if row in read_by_kernel or not state or "shadow_m" not in state:
                    continue
                n = self._shadow_index(group, p)[0].numel()
                if n:
                    items.append((group, p))
                    rows.append(row)
                    shadows.append([local_shard(state[f"shadow_{s}"])[:n] for s in STATES])
                    ages = int(state["m_age"]), int(state["v_age"])
                    corrections.append(self._corrections(group, *ages))
        if items:
            stored = self._sampled_stored_many(items)
            columns = [*zip(*stored, strict=True), *zip(*shadows, strict=True)]
            values = torch.stack([torch.cat(column) for column in columns])
            sums[rows] = shadow.compare(values, [len(m) for m, _ in stored], corrections)
        return sums

    def _live_plans(self) -> list[_Plan]:
        """The plans whose shards' counters are bound now: the plan of all parameters, or
        the unit plans of :meth:`step_unit`."""
        return [self._plan] if self._plan is not None else list(self._unit_plans.values())

    @staticmethod
    def _corrections(group: dict, age_m: int, age_v: int) -> tuple[float, float, float]:
        """A parameter's bias corrections at these state ages and its group's eps, as
        :func:`srtrain.optim.shadow.compare` takes them."""
        return (*shadow.bias_corrections(*group["betas"], age_m, age_v), group["eps"])

    @torch.no_grad()
    def restart_shadow(self, p: torch.Tensor) -> None:
        """Set ``p``'s shadow to its stored states' values (for a shadow that could not be
        restored, such as one saved at another world size): it then measures the drift from
        there on."""
        group = next(g for g in self.param_groups if any(q is p for q in g["params"]))
        state = self.state[p]
        n = self._shadow_index(group, p)[0].numel()
        for which in STATES:
            local_shard(state[f"shadow_{which}"]).zero_()
        if n:
            m_s, v_s = self._sampled_stored(group, p)
            local_shard(state["shadow_m"])[:n].copy_(m_s)
            local_shard(state["shadow_v"])[:n].copy_(v_s)

    def _step_reference(
        self,
        group: dict,
        p: torch.Tensor,
        stream: int,
        health: bool,
        gate: torch.Tensor | None = None,
    ) -> None:
        """The PyTorch spec on one shard (CPU, or ``backend='torch'``), counting the health
        counts with ``health``; ``gate`` as :meth:`step_unit` takes it."""
        state = self.state[p]
        for key in COUNTERS:
            state[key] += 1
        beta1, beta2 = group["betas"]
        step, seed = int(state["step"]), group["seed"]
        age_m, age_v = int(state["m_age"]), int(state["v_age"])
        scalars = AdamWScalars.make(
            group["lr"],
            beta1,
            beta2,
            group["eps"],
            group["weight_decay"],
            age_m,
            age_v,
            rewarmup_factor(step, age_m, age_v, group["rewarmup"]),
        )
        plan = RoundingPlan(
            m_stochastic=group["m_rounding"] == "stochastic",
            v_stochastic=group["v_rounding"] == "stochastic",
            param_stochastic=group["param_rounding"] == "stochastic",
            key_states=rng_key(seed, step, stream, STATE_MOMENTS),
            key_param=rng_key(seed, step, stream, STATE_PARAM),
        )
        counts = self._counts_buffer(local_shard(p).device)
        adamw_step_reference(
            local_shard(p),
            local_shard(p.grad).contiguous(),
            self._state_view(group, p, "m"),
            self._state_view(group, p, "v"),
            scalars,
            plan,
            shard_offset(p),
            counts[stream],
            health,
            **({} if gate is None else {"grad_scale": gate}),
        )

    def _replan(self, key: tuple, streams: tuple[int, ...] | None = None) -> _Plan:
        """Sort the shards with gradients (creating missing states) into the spec path and the
        fused path, with one MultiStep per :class:`~srtrain.kernels.launch.LaunchKey` over the
        non-empty ones: shards whose rows cannot be vectorised launch apart from those whose
        rows can, and shards of rows narrower than a tile apart from those of wider rows.

        Over every parameter (the plan of :meth:`step`), or over those numbered ``streams``
        (a plan of :meth:`step_unit`); either kind drops the plans of the other."""
        from srtrain.kernels.launch import MultiStep, Shard, launch_key, shard_signature

        reference, fused = [], []
        stream = -1
        chosen_streams = None if streams is None else set(streams)
        for index, group in enumerate(self.param_groups):
            for p in group["params"]:
                stream += 1
                if p.grad is None or (chosen_streams is not None and stream not in chosen_streams):
                    continue
                if not self.state[p]:
                    self._init_state(group, p)
                entry = _Entry(index, stream, p)
                (fused if self._use_triton(group, p.device) else reference).append(entry)
        launch_keys, shards = [], []
        for e in fused:
            local, group = local_shard(e.param), self.param_groups[e.group]
            shard = Shard(
                local,
                self._state_view(group, e.param, "m"),
                self._state_view(group, e.param, "v"),
                shard_offset(e.param),
                e.stream,
            )
            shards.append(shard)
            signature = shard_signature(
                shard,
                local_shard(e.param.grad).dtype,
                group["m_rounding"] == "stochastic",
                group["v_rounding"] == "stochastic",
                group["param_rounding"] == "stochastic",
            )
            launch_keys.append(launch_key(shard, signature) if local.numel() else None)
        launches = []
        for launch, rows in _rows(launch_keys).items():
            if launch is None:  # empty shards
                continue
            chosen = np.arange(len(fused))[rows]
            members = [fused[i] for i in chosen]
            signature = launch.signature
            step = MultiStep(
                [shards[i] for i in chosen],
                signature.grad_dtype,
                signature.m_stochastic,
                signature.v_stochastic,
                signature.param_stochastic,
            )
            launches.append(
                _Launch(
                    step,
                    members,
                    [e.stream for e in members],
                    rows,
                    self._counts_buffer(signature.device),
                    any(isinstance(e.param, DTensor) for e in members),
                )
            )
        plan = _Plan(
            key,
            reference,
            fused,
            self._counter_rows(fused),
            np.array([e.stream for e in fused], dtype=np.int64),
            _rows([e.group for e in fused]),
            _rows([self.param_groups[e.group]["seed"] for e in fused]),
            launches,
        )
        if streams is None:
            self._plan = plan
            self._unit_plans.clear()
        else:
            self._plan = self._prepared = None
            self._unit_plans[streams] = plan
        return plan

    def _counter_rows(self, entries: list[_Entry]) -> torch.Tensor:
        """The entries' step and ages as one [n, 3] int64 CPU tensor; their state entries become
        0-d views of its rows."""
        rows = torch.tensor(
            [[int(self.state[e.param][k]) for k in COUNTERS] for e in entries], dtype=torch.int64
        ).reshape(len(entries), len(COUNTERS))
        for i, e in enumerate(entries):
            state = self.state[e.param]
            for j, k in enumerate(COUNTERS):
                state[k] = rows[i, j]
        return rows

    def _stage(
        self,
        plan: _Plan,
        grads: list[torch.Tensor | None] | dict[int, torch.Tensor | None],
        ages: np.ndarray,
        gate: torch.Tensor | None = None,
    ) -> list:
        """Keys and scalars of the fused shards at counters ``ages`` (made at once), staged
        for each launch with ``gate`` (:meth:`step_unit`); ``grads`` holds the gradient of each
        of the plan's parameters by stream number."""
        from srtrain.kernels.launch import KEY_COLUMNS

        keys = np.empty((len(ages), KEY_COLUMNS), dtype=np.int64)
        floats = np.empty((len(ages), 8), dtype=np.float32)
        for seed, rows in plan.seed_rows.items():
            k0, k1 = rng_keys(seed, ages[rows, 0], plan.streams[rows], (STATE_MOMENTS, STATE_PARAM))
            keys[rows, 0] = k0
            keys[rows, 1:] = k1
        for index, rows in plan.group_rows.items():
            group = self.param_groups[index]
            beta1, beta2 = group["betas"]
            counters = ages[rows]  # step, m age, v age of each shard
            if (counters == counters[0]).all():  # the group's shards step and reset together
                distinct, inverse = counters[:1], 0
            else:
                distinct, inverse = np.unique(counters, axis=0, return_inverse=True)
                inverse = inverse.reshape(-1)
            table = np.array(
                [
                    AdamWScalars.make(
                        group["lr"],
                        beta1,
                        beta2,
                        group["eps"],
                        group["weight_decay"],
                        int(age_m),
                        int(age_v),
                        rewarmup_factor(int(step), int(age_m), int(age_v), group["rewarmup"]),
                    ).row()
                    for step, age_m, age_v in distinct
                ],
                dtype=np.float32,
            )
            floats[rows] = table[inverse]
        staged = []
        for launch in plan.launches:
            launch_grads = list(map(grads.__getitem__, launch.streams))
            if launch.distributed:
                launch_grads = [local_shard(g) for g in launch_grads]
            gated = {} if gate is None else {"gate": gate}
            staged.append(
                launch.step.stage(launch_grads, keys[launch.rows], floats[launch.rows], **gated)
            )
        return staged

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load hyperparameters as torch does, and the states as saved: torch would cast every
        state tensor to the parameter's dtype, which corrupts integer codes. The next step
        rebuilds its launch tables."""
        saved_groups = state_dict["param_groups"]
        super().load_state_dict({**state_dict, "state": {}})
        saved_ids = [i for g in saved_groups for i in g["params"]]
        for saved_id, p in zip(saved_ids, self._params(), strict=True):
            saved = state_dict["state"].get(saved_id)
            if saved is None:
                continue
            device = local_shard(p).device  # codes and scales live with the shard; counters on CPU
            self.state[p] = {
                key: value.detach()
                .clone()
                .to(
                    device
                    if key.endswith(("_codes", "_scales")) or key.startswith("shadow_")
                    else value.device
                )
                if isinstance(value, torch.Tensor) and not isinstance(value, DTensor)
                else value
                for key, value in saved.items()
            }
        self._plan = None
        self._unit_plans.clear()
        self._prepared = None
