"""Reset schedules for optimizer states that every rank follows together.

Modes:
- ``periodic``: reset m every ``m_period`` steps and v every ``v_period`` steps;
- ``theory``: the same, with periods from :func:`srtrain.theory.reset_period` for each
  state's format, rounding and β (see its docstring for the derivation);
- ``adaptive``: every ``window`` steps, one all-reduce gives each state's stalled
  fraction over the window across the shard group (all ranks, or one replica's ranks
  under HSDP); a state whose fraction exceeds
  ``threshold`` and whose age is at least ``min_age`` is reset;
- ``none``.

Decisions depend only on the global step, the config and all-reduced counts, so
every rank resets the same states at the same step.

A reset of v always resets m too: right after a v-only reset, v̂ is one step's g² while
m̂ still averages many past gradients, so m̂/√v̂ is unbounded wherever the current
gradient is small, and training diverges (validation loss 3.0 → 8.2 on LLaMA-60M). With
both reset, |m̂/√v̂| is bounded as in any Adam step (at age 1 it is 1 for every element;
``resets.rewarmup`` scales the first steps down). An m-only reset is safe (the update
restarts small against the old v).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from srtrain.theory import reset_period

STATES = ("m", "v")


class ResetSchedule:
    """Decides after each optimizer step which states to reset."""

    def __init__(
        self,
        mode: str,
        *,
        m_period: int = 0,
        v_period: int = 0,
        formats: dict[str, str] | None = None,
        roundings: dict[str, str] | None = None,
        betas: dict[str, float] | None = None,
        tolerance: float = 200.0,
        threshold: float = 0.9,
        window: int = 50,
        min_age: int = 100,
        states: str = "both",
        device: torch.device | str = "cpu",
    ) -> None:
        self.mode = mode
        managed = STATES if states == "both" else (states,)
        self.periods = {"m": 0, "v": 0}
        if mode == "periodic":
            self.periods = {"m": m_period, "v": v_period}
        elif mode == "theory":
            for s in managed:
                self.periods[s] = reset_period(formats[s], betas[s], roundings[s], s, tolerance)
        elif mode not in ("none", "adaptive"):
            raise ValueError(f"unknown reset mode {mode!r}")
        self.managed = (
            managed if mode == "adaptive" else tuple(s for s in STATES if self.periods[s] > 0)
        )
        self.threshold = threshold
        self.window = window
        self.min_age = min_age
        self.ages = {"m": 0, "v": 0}
        self.last_fractions: dict[str, float] = {}
        # adaptive: window sums of (m stalled, v stalled, elements) on the device
        self._window_counts = torch.zeros(3, dtype=torch.int64, device=device)
        self._window_steps = 0

    def observe(self, counts: torch.Tensor, local_elements: int) -> None:
        """Add one step's local [P, NUM_COUNTS] counts, of which the stall columns count
        (adaptive mode; no host sync)."""
        if self.mode != "adaptive":
            return
        self._window_counts[:2] += counts[:, :2].sum(dim=0)
        self._window_counts[2] += local_elements
        self._window_steps += 1

    def after_step(self, step: int, group: dist.ProcessGroup | None = None) -> list[str]:
        """States to reset after optimizer step ``step`` (1-based); ages advance. ``group``:
        the shard group the adaptive window's counts are summed over (default all ranks)."""
        for s in STATES:
            self.ages[s] += 1
        due: list[str] = []
        if self.mode in ("periodic", "theory"):
            due = [s for s in STATES if self.periods[s] and step % self.periods[s] == 0]
        elif self.mode == "adaptive" and self._window_steps >= self.window:
            totals = self._window_counts.clone()
            if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
                dist.all_reduce(totals, group=group)
            m_stalled, v_stalled, elements = (int(x) for x in totals.tolist())
            self.last_fractions = {
                "m": m_stalled / max(elements, 1),
                "v": v_stalled / max(elements, 1),
            }
            self._window_counts.zero_()
            self._window_steps = 0
            due = [
                s
                for s in self.managed
                if self.last_fractions[s] > self.threshold and self.ages[s] >= self.min_age
            ]
        if "v" in due and "m" not in due:
            due = ["m", "v"]
        for s in due:
            self.ages[s] = 0
        return due

    def state_dict(self, group: dist.ProcessGroup | None = None) -> dict[str, int]:
        """Plain integers, the same on every rank: ages and the adaptive window's sums over
        ``group`` (the shard group, as in :meth:`after_step`; a collective call when the
        window is in use)."""
        counts = self._window_counts.clone()
        if self._window_steps and dist.is_initialized() and dist.get_world_size(group) > 1:
            dist.all_reduce(counts, group=group)
        m, v, elements = (int(x) for x in counts.tolist())
        return {
            "age_m": self.ages["m"],
            "age_v": self.ages["v"],
            "window_m": m,
            "window_v": v,
            "window_elements": elements,
            "window_steps": self._window_steps,
        }

    def load_state_dict(self, state: dict[str, int], holds_window: bool = True) -> None:
        """Restore :meth:`state_dict`; the window's global sums go to one rank of each shard
        group (``holds_window``), the others start it from zero, so its all-reduce is
        unchanged."""
        self.ages = {"m": int(state["age_m"]), "v": int(state["age_v"])}
        sums = [state["window_m"], state["window_v"], state["window_elements"]]
        self._window_counts.copy_(
            torch.tensor(sums if holds_window else [0, 0, 0], dtype=torch.int64)
        )
        self._window_steps = int(state["window_steps"])


def schedule_from_config(resets, optim, device: torch.device | str) -> ResetSchedule:
    """A :class:`ResetSchedule` from the ``resets`` and ``optim`` config sections."""
    return ResetSchedule(
        resets.mode,
        m_period=resets.m_period,
        v_period=resets.v_period,
        formats={"m": optim.m_format, "v": optim.v_format},
        roundings={"m": optim.m_rounding, "v": optim.v_rounding},
        betas={"m": optim.beta1, "v": optim.beta2},
        tolerance=resets.tolerance,
        threshold=resets.threshold,
        window=resets.window,
        min_age=resets.min_age,
        states=resets.states,
        device=device,
    )
