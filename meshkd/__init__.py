"""meshkd: distill a large teacher LLM into a student that lives on a disjoint set of ranks.

Three layers, each a package:

- `meshkd.core`: the torch-only library: who is where (`topology`), how values travel (`wire`, `bridge`),
  the teacher request between the roles (`teacher_protocol`), the teacher's answers, one registered class a mode
  (`answers`), sharded logits (`logits`), the losses (`loss`), NEAT packing (`packing`), stage broadcasts
  (`stage_broadcast`) and one status agreement across ranks (`agreement`).
- `meshkd.parallel`: laying a transformers model out, one concern per module (`stages`,
  `tensor_parallel`, `context_parallel`, `data_parallel`, `sharded_loading`, `teacher_runner`,
  `student_pipeline`).
- `meshkd.recipe`: the training recipe and its inputs, in layered sub-packages: `common` (`metrics`,
  `faults`, `files`), `settings` (`config`), `corpus` (`data`), `modeling` (`models`, `checkpoint`),
  `teacher` (`teacher_worker`), `student` (`train_step`), `lifecycle` (`preflight`, `student_trainer`, `run`).

The documented API is re-exported by `meshkd.kd_utils` and `meshkd.pipeline_parallel`.
"""

__version__ = "0.1.0"
