"""Vision side of ALMA (paper §4-§6.1, App. A-C): data, backbones, the six learners, stage
training with best-validation selection, FLOP counting and an in-process stream runner.

Nothing is imported here (importing ``fairseq_alma`` must stay cheap); import the submodule:
``data`` (loaders), ``dataset`` (``VisionData``), ``learners`` (``LearnerSpec``),
``learner_builder`` (``build_learner``), ``stage_trainer``
(``train_stage``, ``evaluate``), ``stream_stage`` (``train_one_stage``), ``runner``
(``run_vision_stream``), ``normalization`` (statistics of the arrived mega-batches).
"""
