"""The drop-in: what makes a stock DeepSpeed pipeline job run a new schedule unchanged.

The re-cut ``PipelineModule`` placing several stages per rank (``module``), the stock module's
weights and the optimizer's groups carried onto it (``carry``, ``optim_carry``), and
checkpoints that cross schedules and pipeline sizes (``checkpoint``, its layout file in
``layout_file``), saved atomically across ranks (``commit``, ``atomic``) and checked against the
save's file record before a load (``manifest``, ``integrity``), with the state beyond weights
and optimizer that an exact resume needs (``runtime_state``: RNG, post-validation's streak,
auto's choice). May import DeepSpeed,
torch, ``transfers`` (for the device) and the config's errors.
"""
