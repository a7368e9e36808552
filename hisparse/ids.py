"""The two id spaces of HiSparse, kept apart by type (sgl#31482 corrupted output by mixing them).

A `HostPage` names one virtual page of the cache and its place in the pinned host mirror; a
`DeviceSlot` names one page-sized slot of a layer's device buffer. Arrays of either are int64
(the dtype every index operation wants); the name of the field or argument says which one it
holds, and the two `NewType`s make mypy reject a slot where a page is expected.
"""

from __future__ import annotations

from typing import NewType

import numpy as np
import numpy.typing as npt

HostPage = NewType("HostPage", int)
DeviceSlot = NewType("DeviceSlot", int)

#: dtype of every host-page and device-slot array the coordinator returns
ID_DTYPE = np.int64

HostPageArray = npt.NDArray[np.int64]
DeviceSlotArray = npt.NDArray[np.int64]
