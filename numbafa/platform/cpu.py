"""The CPU this process runs on, read from Linux ``/proc/cpuinfo``.

:mod:`numbafa.platform.onednn` chooses the GEMM path by the CPU's feature flags, and
:func:`numbafa.backend_info` reports them with the CPU model. Off Linux (no
``/proc/cpuinfo``) every function here says "unknown": ``{}`` or None.
"""

from __future__ import annotations

__all__ = ["first_cpu", "cpu_flags", "cpu_model"]


def first_cpu() -> dict:
    """The fields of the first CPU in Linux ``/proc/cpuinfo`` (``{}`` where unavailable)."""
    fields = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    if fields:
                        break
                    continue
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return fields


def cpu_flags():
    """The CPU feature flags (Linux ``/proc/cpuinfo``), or None where unavailable."""
    flags = first_cpu().get("flags")
    return None if flags is None else set(flags.split())


def cpu_model():
    """``"<model name> (<vendor>, family F, model M)"`` from Linux ``/proc/cpuinfo`` (first CPU),
    or None where unavailable: the model name alone does not tell CPU generations apart
    (VMs often say just "AMD EPYC")."""
    fields = first_cpu()
    if "model name" not in fields:
        return None
    return (f"{fields['model name']} ({fields.get('vendor_id', '?')}, family {fields.get('cpu family', '?')}, "
            f"model {fields.get('model', '?')})")
