"""pat: prefix-aware decode attention for LLM serving (pack, forward, merge).

Public API
----------
``PrefixAttentionWrapper``    plan()/run()/stats(): the entry point
``Plan``                      the packed, tiled execution plan (NumPy int32 arrays)
``BlockTable``                normalised block-table input (padded, lists or CSR)
``PrefixForest``              the batch's radix tree over page ids
``dense_attention``           float64 reference
``merge_state``               log-sum-exp merge of two attention states
"""
from .forest import PrefixForest
from .gpus import GPUS, GPUSpec, get_gpu
from .inputs import BlockTable
from .merge import merge_partials, merge_state
from .packers import PACKERS
from .plan import Plan
from .planner import Planner
from .reference import dense_attention
from .tuning import Tuning
from .wrapper import PrefixAttentionWrapper

__version__ = "0.1.0"

__all__ = ["PrefixAttentionWrapper", "Plan", "Planner", "Tuning", "BlockTable", "PrefixForest",
           "dense_attention", "merge_state", "merge_partials", "PACKERS", "GPUS", "GPUSpec",
           "get_gpu", "__version__"]
