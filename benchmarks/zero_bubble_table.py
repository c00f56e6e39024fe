"""The zero-bubble paper's bubble-rate table, read from ``zero_bubble_table.json``,
and what unisched makes of each of its settings.

Each row of the table is a setting (model, p stages on p workers, m
micro-batches) with its profiled pass times T_F, T_B (input gradient), T_W
(weight gradient) and T_comm (one hop between adjacent stages), and the
bubble rates the paper computed from them.  :func:`costs` turns a row into
unisched's costs (T_comm a latency on every hop, nothing occupying a link,
as in the paper's model), :func:`simulated` runs a named strategy on it and
measures the paper's bubble rate (:func:`unisched.metrics.bubble_rate`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import NamedTuple

from unisched import Costs, policies, simulate
from unisched.metrics import bubble_rate

TABLE = Path(__file__).with_name("zero_bubble_table.json")

OURS = {"1F1B": "one_f_one_b", "ZB-H1": "zb_h1", "ZB-H2": "zb_h2"}
"""The paper's hand-made columns and the unisched strategy of each."""


class Setting(NamedTuple):
    """One row of the paper's table."""

    model: str
    p: int
    m: int
    T_F: float
    T_B: float
    T_W: float
    T_comm: float
    paper: dict[str, float]
    """The paper's bubble rate per schedule (1F1B, 1F1B-I, ZB-H1, ZB-H2, ZB-1p, ZB-2p)."""
    weight_pass_keeps: float
    """M_W / M_B: the share of a micro-batch's activations still held after its I pass."""

    @property
    def label(self) -> str:
        return f"{self.model} p={self.p} m={self.m}"


def settings() -> list[Setting]:
    """Every row of the table, in the paper's order."""
    data = json.loads(TABLE.read_text())
    return [Setting(row["model"], row["p"], row["m"], row["T_F"], row["T_B"], row["T_W"], row["T_comm"],
                    row["bubble_rate"], _weight_pass_keeps(data["models"][row["model"]]))
            for row in data["rows"]]


def costs(setting: Setting) -> Costs:
    """The row's times as unisched costs: split passes for the zero-bubble
    schedules, B + W as one backward for 1F1B, T_comm on every hop."""
    return Costs(forward=setting.T_F, backward=setting.T_B + setting.T_W, backward_input=setting.T_B,
                 backward_weight=setting.T_W, latency=setting.T_comm,
                 input_grad_frees=1.0 - setting.weight_pass_keeps)


def simulated(setting: Setting, column: str) -> float:
    """The bubble rate of unisched's strategy for ``column`` (a key of ``OURS``) on this setting."""
    p, m = setting.p, setting.m
    return bubble_rate(simulate(p, p, m, policies.get(OURS[column], p, p, m), costs=costs(setting)).timeline)


def _weight_pass_keeps(model: dict) -> float:
    """M_W / M_B per transformer layer (the paper's Table 1): 32 s b h of sb(34h + 5as)."""
    h, a, s = model["hidden_size"], model["attention_heads"], model["sequence_length"]
    return 32 * h / (34 * h + 5 * a * s)
