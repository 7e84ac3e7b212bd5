"""Measuring: activation memory (``memory``), layer times and memory for
``partition_method: "profile"`` (``profile``), and ``schedule: "auto"``, which measures a
few steps and picks a schedule (``auto``, an engine subclass). May import the schedule layer,
the config and ``tuning``, ``dropin``, ``transfers``, ``program`` (instruction types) and
``step_end`` (the model-parallel size); ``auto`` also the engine.
"""
