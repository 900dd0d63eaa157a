"""saltserve's own kernels (map: docs/kernels.md).

- ``kernels.cpu_linear``, ``kernels.cpu_ops``: the Python APIs of our C++ CPU kernels, each
  with a torch fallback.
- ``kernels.cpu``: those kernels' sources, their one loader (``kernels.cpu.build``), op
  bindings and projection kinds.
- ``kernels.triton``: the Triton kernels of the ``triton`` attention backend.
"""
