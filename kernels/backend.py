"""Attention backend selection for the model (the Triton backend lands with the kernels issue)."""

from __future__ import annotations


def use_triton_backend(model) -> None:
    """Switches ``model`` to the Triton paged-attention kernels.

    Raises:
        NotImplementedError: until the Triton kernels are implemented.
    """
    raise NotImplementedError("the triton attention backend is not implemented yet; "
                              "use --attention-backend torch")
