"""Pipeline schedules as pure data: IR, placement, generators, validation.

Imports neither torch.distributed nor deepspeed.
"""

from .costs import Costs
from .ir import BW, Action, B, F, Kind, Schedule, W, parse_action
from .placement import linear, looped, vshape
from .registry import GeneratorInfo, ScheduleNameError, generate, get_info, register, schedule_names, split_backward_names
from .simulate import SimResult, simulate
from .validate import ScheduleError, prerequisites, validate

__all__ = [
    "Action", "B", "BW", "Costs", "F", "GeneratorInfo", "Kind", "Schedule", "ScheduleError",
    "ScheduleNameError", "SimResult", "W", "generate", "get_info", "linear", "looped", "parse_action",
    "prerequisites", "register", "schedule_names", "simulate", "split_backward_names", "validate", "vshape",
]
