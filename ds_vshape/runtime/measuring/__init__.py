"""Measuring: activation memory (``memory``), layer times and memory for
``partition_method: "profile"`` (``profile``), and ``schedule: "auto"``, which measures a
few steps and picks a schedule (``auto``, an engine subclass). May import the schedule layer,
the config and ``tuning``, ``dropin``, ``transfers`` and ``program`` (instruction types);
``auto`` also the engine.
"""
