"""Which learner a method name means: the one choice between the fixed-size learners
(``learners``) and the growing ones (``learners_growing``).

Kept in its own file because the growing learners build on the fixed ones: the choice has to sit
above both, or the two learner files would import each other.
"""

from __future__ import annotations

from .learners import Learner, LearnerSpec, StackedLearner
from .learners_growing import FireflyLearner, GrowingEnsemble, GrowingMoE


def build_learner(spec: LearnerSpec, input_shape: tuple[int, ...], num_classes: int) -> Learner:
    """The learner for ``spec.method`` on inputs of ``input_shape`` with ``num_classes`` classes."""
    if spec.method in ("sm", "ens", "umix"):
        return StackedLearner(spec, input_shape, num_classes)
    if spec.method == "gens":
        return GrowingEnsemble(spec, input_shape, num_classes)
    if spec.method == "gmoe":
        return GrowingMoE(spec, input_shape, num_classes)
    return FireflyLearner(spec, input_shape, num_classes)
