"""Memory of a training step, per device: estimated, simulated, and checked before training starts.

    check_run_fits(...) the start-up pre-flight training calls with its run plan
                        (`toolkit.memory.preflight`): refuses, in one line, a set-up whose step
                        will not fit, and names one that does (`check_fits`, the same by settings)
    estimate(...)       `toolkit estimate`: the memory per device of each strategy, and what fits
                        a budget (`toolkit.memory.estimator`)
    simulate(...)       the real training step on fake tensors and fake ranks, tracked by torch's
                        FSDPMemTracker (`toolkit.memory.simulation`)

What the estimate knows about the model comes from the model itself: its parameters from `GPT`
built on the meta device (`parameters`), what autograd saves from the model's forward and
backward passes on fake tensors (`activations`); `moments` says what is alive at each moment of a
step at which it can peak. Nothing here imports the training code or the entry points.
"""

from toolkit.memory.estimator import estimate
from toolkit.memory.options import GiB
from toolkit.memory.preflight import check_fits, check_run_fits
from toolkit.memory.simulation import Simulation, simulate

__all__ = ["GiB", "Simulation", "check_fits", "check_run_fits", "estimate", "simulate"]
