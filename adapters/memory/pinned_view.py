"""A CUDA tensor aliasing pinned host memory (zero-copy): device kernels read and write the host
mirror directly over the bus, without a copy engine, a staging buffer or a host call.

Under unified virtual addressing a pinned allocation (`torch.empty(..., pin_memory=True)`, i.e.
``cudaHostAlloc``) is mapped into the device's address space at the same address. A CUDA tensor
over it is made from an object exposing ``__cuda_array_interface__`` (version 3: shape,
typestr, ``data=(ptr, read_only)``) passed to ``torch.as_tensor(obj, device="cuda")``; CuPy is
not needed. The view does not own the memory: the caller keeps the host tensor alive (the
returned view holds a reference to it through its interface object).
"""

from __future__ import annotations

import torch

#: the integer type of each element size: the interface has no bfloat16 typestr, so the view
#: is made over integers of the same size and reinterpreted
_INT_OF_SIZE = {1: ("<i1", torch.int8), 2: ("<i2", torch.int16), 4: ("<i4", torch.int32),
                8: ("<i8", torch.int64)}  # fmt: skip


class _PinnedInterface:
    """``__cuda_array_interface__`` of a contiguous pinned host tensor (kept alive)."""

    def __init__(self, host: torch.Tensor) -> None:
        self.host = host  # keeps the memory alive as long as the view
        typestr, _ = _INT_OF_SIZE[host.element_size()]
        self.__cuda_array_interface__ = {
            "shape": tuple(host.shape),
            "typestr": typestr,
            "data": (host.data_ptr(), False),
            "version": 3,
            "strides": None,
        }


def mapped_view(  # pragma: no cover - CUDA only
    host: torch.Tensor, device: torch.device
) -> torch.Tensor | None:
    """A CUDA tensor aliasing the pinned, contiguous ``host`` (same shape and dtype), or
    ``None`` where the mapping fails or the device cannot read it back (the caller then keeps
    its staged copies, or refuses what needs the mapping)."""
    if not (host.is_pinned() and host.is_contiguous()) or host.element_size() not in _INT_OF_SIZE:
        return None
    try:
        with torch.cuda.device(device):
            view = torch.as_tensor(_PinnedInterface(host), device=device)
        view = view.view(host.dtype)
        probe = view[:1].clone()  # the GPU can read it
        if not torch.equal(probe.cpu(), host[:1]):
            return None
        return view
    except Exception:  # noqa: BLE001 - any failure: the caller falls back or refuses
        return None
