"""Our C++ CPU kernels, built into one torch extension (``saltserve_cpu``).

- ``build.py``: the loader (``load()``, ``loaded()``): compiles every ``*.cpp`` here.
- ``bindings.cpp``: every op's schema and registration; ``ops.h`` declares the kernel
  functions, each defined in its own .cpp.
- ``kinds.h`` / ``kinds.py``: the fused decode layer's projection kinds, in C++ and Python.

The Python APIs are ``kernels.cpu_linear`` and ``kernels.cpu_ops``.
"""
