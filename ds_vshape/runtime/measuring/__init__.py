"""Measuring: activation memory (``memory``), layer times and memory for
``partition_method: "profile"`` (``profile``), and ``schedule: "auto"``, which measures a
few steps and picks a schedule (``auto``, an engine subclass). May import the schedule layer,
the config, ``dropin`` and ``transfers``; ``auto`` also the engine.
"""
