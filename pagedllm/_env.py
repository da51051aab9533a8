"""pagedllm's own on/off environment switches (``PAGEDLLM_THP``, ``PAGEDLLM_MALLOC``): one
vocabulary and one error for all of them. Imported before torch loads; imports nothing heavy."""

from __future__ import annotations

OFF = ("0", "off", "false")
ON = ("auto", "1", "on", "true")  # "auto": on where the machine allows it


def auto_or_off(var: str, setting: str) -> bool:
    """True for ``var=auto`` (or 1/on/true), False for ``var=0`` (or off/false); a ValueError
    naming ``var`` for anything else. ``setting`` is already stripped and lower-cased."""
    if setting in OFF:
        return False
    if setting in ON:
        return True
    raise ValueError(f"{var}={setting!r}: use auto or 0")
