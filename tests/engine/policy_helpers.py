"""Kernel choices for tests: every ``KernelPolicy.detect()`` after ``no_int8_dot`` has our
int8-dot kernels off, so engines and layers built from then on take the other paths (torch's
int4 / int8 kernels, the dense copy, our Q4 kernel) on any CPU."""

from __future__ import annotations

from engine.quantization import KernelPolicy


def no_int8_dot(monkeypatch) -> None:
    real = KernelPolicy.detect.__func__

    def detect(cls, **choices):
        return real(cls, **{"int8_dot": False, **choices})

    monkeypatch.setattr(KernelPolicy, "detect", classmethod(detect))
