"""meshkd: distill a large teacher LLM into a student that lives on a disjoint set of ranks.

Layers, each a module: `topology` (who is where) -> `wire` and `transport` (moving batches and logits)
-> `logits` (materializing sharded teacher logits) -> `packing` (NEAT-packed batches). The documented
API is re-exported by `meshkd.kd_utils` and `meshkd.pipeline_parallel`.
"""

__version__ = "0.1.0"
