"""`Through`: an attribute of the runner that is one of its components' attributes, read and
written through. The runner's long-standing names (``_running``, ``pool_balance``,
``on_logits``, ``decoder``, ...) stay where callers and tests look for them while the state
lives in the component that owns it; assigning one (a test wrapping ``_forward``, a caller
setting ``on_logits``) sets the component's, so the component's own calls see it."""

from __future__ import annotations

from typing import Any


class Through:
    """``owner.attr`` of the instance: ``owner`` a dotted path of attributes (``"a.b"``)."""

    def __init__(self, owner: str, attr: str) -> None:
        self.path, self.attr = owner.split("."), attr

    def _owner(self, instance: object) -> Any:
        for name in self.path:
            instance = getattr(instance, name)
        return instance

    def __get__(self, instance: object, cls: type | None = None) -> Any:
        if instance is None:
            return self
        return getattr(self._owner(instance), self.attr)

    def __set__(self, instance: object, value: Any) -> None:
        setattr(self._owner(instance), self.attr, value)
