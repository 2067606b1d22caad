"""The engine's step bookkeeping as one object with ``state_dict()``: what a checkpoint saves
of the training progress, and where the accumulation window stands."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: the counters a checkpoint's model-states file holds (DeepSpeed's key names)
COUNTERS = ("global_steps", "global_samples", "skipped_steps", "micro_steps")


@dataclass
class TrainState:
    """Counters of micro-steps, optimizer steps, samples and skipped steps."""

    micro_steps: int = 0
    global_steps: int = 0
    global_samples: int = 0
    skipped_steps: int = 0
    #: ``micro_steps`` when the current accumulation window opened (a loaded checkpoint opens a
    #: new one: it holds no partly accumulated gradients, and may have been saved with another
    #: gradient_accumulation_steps)
    window_start: int = 0
    #: whether the last ``step()`` at a boundary updated the weights (False: overflow skip)
    step_applied: bool = False

    def is_boundary(self, gradient_accumulation_steps: int) -> bool:
        """Whether the current micro-step ends an accumulation window."""
        window = self.micro_steps - self.window_start
        return (window + 1) % gradient_accumulation_steps == 0

    def end_micro_step(self) -> None:
        self.micro_steps += 1

    def end_optimizer_step(self, applied: bool, samples: int) -> None:
        self.step_applied = applied
        if not applied:
            self.skipped_steps += 1
        self.global_steps += 1
        self.global_samples += samples

    def open_window(self) -> None:
        """Start a new accumulation window at the current micro-step."""
        self.window_start = self.micro_steps

    def state_dict(self) -> dict[str, int]:
        return {name: int(getattr(self, name)) for name in COUNTERS}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take the counters ``state`` holds (others keep their values); a new accumulation
        window opens."""
        for name in COUNTERS:
            if name in state:
                setattr(self, name, state[name])
        self.open_window()
