"""In-process card on the CPU: the draft worker's cores go to the target while the worker idles.

On a small CPU the cores are split between the target and the draft worker. The worker idles
whenever every tree it grows is at max depth, which with a draft ~10x faster than the target
is most of each verification: it fills the tree in the first few draft forwards after a
correction and then waits for the next one. Its cores would sit unused while the target, whose
multi-token verify scales with threads (card.engine.loading.cpu_linear), runs on its share alone.

``CoreLender`` hooks the target's linear layers: before each one it sets the target thread's
torch thread count to ``own + lent`` while ``DraftWorker.idle`` is set, and back to ``own``
otherwise. Within one verification the worker cannot wake up (only a command from the target,
after the verification, wakes it), so the switch happens at most once per forward and never
oversubscribes the cores; the target's next command clears ``idle`` before the worker runs.
Thread counts do not change results: the packed kernels are thread-invariant.
"""

from __future__ import annotations

import threading

import torch

from card.engine.loading.cpu_linear import PackedLinear


class CoreLender:
    def __init__(self, model: torch.nn.Module, own_threads: int, lent_threads: int,
                 idle: threading.Event) -> None:
        self.model = model
        self.own = own_threads
        self.lent = lent_threads
        self.idle = idle
        self.layers_borrowed = 0  # linear layers that ran with the lent cores (stats, tests)
        self.layers = 0
        self._current = own_threads
        self._thread: int | None = None
        self._handles: list[torch.utils.hooks.RemovableHandle] = []

    def attach(self) -> None:
        """Start lending: hook every linear layer of the target (call on the target's thread)."""
        if self._handles:
            return
        torch.set_num_threads(self.own)
        self._current = self.own
        self._thread = threading.get_ident()
        for module in self.model.modules():
            if isinstance(module, (torch.nn.Linear, PackedLinear)):
                self._handles.append(module.register_forward_pre_hook(self._before_layer))

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if self._current != self.own:
            torch.set_num_threads(self.own)
            self._current = self.own

    def _before_layer(self, *_: object) -> None:
        if threading.get_ident() != self._thread:
            return  # the draft worker forwarding the same model object (a self-draft)
        borrowing = self.idle.is_set()
        self.layers += 1
        self.layers_borrowed += borrowing
        want = self.own + self.lent if borrowing else self.own
        if want != self._current:
            torch.set_num_threads(want)
            self._current = want
