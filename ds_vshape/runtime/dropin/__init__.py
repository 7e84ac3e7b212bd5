"""The drop-in: what makes a stock DeepSpeed pipeline job run a new schedule unchanged.

The re-cut ``PipelineModule`` placing several stages per rank (``module``), the stock module's
weights and the optimizer's groups carried onto it (``carry``, ``optim_carry``), and
checkpoints that cross schedules and pipeline sizes (``checkpoint``). May import DeepSpeed,
torch, ``transfers`` (for the device) and the config's errors.
"""
