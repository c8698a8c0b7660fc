"""The step-feature protocol, as the core's modules import it: its home is the ``features``
part (``features.protocol``), which the parts implementing features import without a cycle
through the core."""

from services.engine.features.protocol import EAGER, StepFeature, StepFeatures, StepRows

__all__ = ["EAGER", "StepFeature", "StepFeatures", "StepRows"]
