"""The Triton kernels of the ``triton`` attention backend (``engine/attention/triton_backend.py``):
``store_kv_cache`` writes this step's K/V into the paged cache, ``paged_attention`` attends
over it. Tests compare them with plain-torch references (``tests/kernels/triton_reference.py``).
"""
