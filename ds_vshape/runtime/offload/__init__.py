"""Activation offload (``offloader``): a rank's saved activations go to host memory between a
unit's forward and its backward, as ``schedules.offload`` plans. May import the schedule layer
and ``measuring.memory``.
"""
