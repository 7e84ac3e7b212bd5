"""Activation offload: a rank's saved activations go to host memory between a unit's forward
and its backward (``offloader``), and what split backward keeps for W between B and W
(``w_kept``), as ``schedules.offload`` plans; ``host_pool`` reuses the host buffers; ``setup``
checks the config and words what stays on the device at ``initialize``. May import the schedule
layer and ``measuring.memory``.
"""
