"""The emulation's settings as the environment gives them: the mode and each rule's switch."""

from __future__ import annotations

__all__ = ["FIRST_CONTACT_ENV", "MODES", "MODE_ENV", "ONE_QUEUE_ENV", "SYNCHRONIZE_ENV", "TIMEOUT_ENV", "env_first_contact",
           "env_mode", "env_switch"]

MODES = ("eager", "lazy")
MODE_ENV = "DS_VSHAPE_NCCL_EMULATION"  # set by tests/distributed/launch.py: "eager", "lazy" ("1" = eager)
TIMEOUT_ENV = "DS_VSHAPE_NCCL_TIMEOUT_S"
FIRST_CONTACT_ENV = "DS_VSHAPE_NCCL_FIRST_CONTACT"  # "1": a first p2p call with a peer blocks until the peer's
SYNCHRONIZE_ENV = "DS_VSHAPE_NCCL_SYNCHRONIZE"  # "1": the accelerator's synchronize() waits for every op the rank queued
ONE_QUEUE_ENV = "DS_VSHAPE_NCCL_ONE_QUEUE"  # "1": every communicator of a rank feeds one ordered queue


def env_mode(value: str | None) -> str | None:
    """The mode the env var ``MODE_ENV`` asks for: None when unset or empty."""
    if not value:
        return None
    if value == "1":
        return "eager"
    if value not in MODES:
        raise ValueError(f"{MODE_ENV}={value!r}: use 'eager', 'lazy' or '1' (eager)")
    return value


def env_first_contact(value: str | None) -> bool:
    """Whether the env var ``FIRST_CONTACT_ENV`` turns the first-contact rule on."""
    return env_switch(FIRST_CONTACT_ENV, value)


def env_switch(name: str, value: str | None) -> bool:
    """Whether a rule's env var (``FIRST_CONTACT_ENV``, ``SYNCHRONIZE_ENV``, ``ONE_QUEUE_ENV``) turns it on."""
    if value in (None, "", "0"):
        return False
    if value != "1":
        raise ValueError(f"{name}={value!r}: use '1' (on) or '0' (off)")
    return True
