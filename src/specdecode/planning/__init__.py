"""Planning a step: how many guesses, how deep, whether the draft model runs at all, from measured
pass costs (costs.py), acceptance learned online (calibration.py), the cost decisions (planner.py) and
the tree drafter that grows and cuts the guesses (tree.py); and what a pass costs beside other generations' in
continuous batching (batch.py, imported where slots are made)."""

from .costs import CostModel, load_or_measure
from .planner import TreeState, chain_speedup, draft_model_can_pay
from .tree import TreeDrafter

__all__ = ["CostModel", "TreeDrafter", "TreeState", "chain_speedup", "draft_model_can_pay", "load_or_measure"]
